//! Keys and values: per layer ([`LayerCache`], written in place while decoding) and per batch
//! ([`KvCache`]: rows prefilled from earlier sequences, selected, appended, trimmed).

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
}

impl Clone for LayerCache {
    fn clone(&self) -> Self {
        LayerCache {
            keys_values: self.keys_values.clone(),
            state: self.state.clone(),
            room: None,
        }
    }
}

impl LayerCache {
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
    /// Keys and values `[1, kv_heads, n, head_dim]`.
    KeysValues(Tensor, Tensor),
    /// A linear-attention layer's states after the sequence's last token (see [`LayerCache`]), with one
    /// row.
    State(Tensor, Tensor),
}

impl LayerSequence {
    /// What the layer keeps of the sequence's first `length` of its `whole` tokens: keys and values for
    /// any prefix, a state only for the whole sequence (`None` otherwise).
    pub fn prefix(&self, length: usize, whole: usize) -> Result<Option<LayerSequence>> {
        Ok(match self {
            LayerSequence::KeysValues(k, v) => Some(LayerSequence::KeysValues(
                k.narrow(2, 0, length)?,
                v.narrow(2, 0, length)?,
            )),
            LayerSequence::State(..) if length == whole => Some(self.clone()),
            LayerSequence::State(..) => None,
        })
    }
}

/// What each layer keeps of one sequence.
pub type SequenceCache = Vec<LayerSequence>;

/// Whether a sequence's cache can start a longer prompt that shares only a part of it: not when a
/// layer keeps a state, which holds the whole sequence.
pub fn reusable_in_part(layers: &SequenceCache) -> bool {
    layers
        .iter()
        .all(|layer| matches!(layer, LayerSequence::KeysValues(..)))
}

/// One batch of [`Model::forward_segments`]: token ids and positions `[B, T]`, the key mask over its
/// cached columns and the `T` new ones, and its cache.
pub struct Segment<'c> {
    pub input_ids: Tensor,
    pub positions: Tensor,
    pub key_mask: Tensor,
    pub cache: &'c mut KvCache,
}

/// The key/value cache of a batch, one entry per layer.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub(super) layers: Vec<LayerCache>,
}

impl KvCache {
    pub fn new(config: &ModelConfig) -> Self {
        KvCache {
            layers: vec![LayerCache::default(); config.num_hidden_layers],
        }
    }

    /// Columns allocated per row: [`KvCache::len`] and the spare columns that decoding steps write into.
    pub fn capacity(&self) -> usize {
        self.layers
            .iter()
            .find_map(|layer| layer.room.as_ref().or(layer.keys_values.as_ref()))
            .map_or(0, |(keys, _)| keys.dim(2).unwrap_or(0))
    }

    /// Cached positions (columns), counted by the attention layers' keys.
    pub fn len(&self) -> usize {
        self.layers
            .iter()
            .find_map(|layer| layer.keys_values.as_ref())
            .map_or(0, |(k, _)| k.dim(2).unwrap_or(0))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts the cache from earlier sequences: row `b` gets `reused[b]`'s keys and values (each layer
    /// `[1, kv_heads, n, head_dim]`), right-aligned in `width` columns (zeros before, masked by the caller),
    /// or only zeros; a linear-attention layer gets the sequence's states, or zero states.
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
                        Some(LayerSequence::KeysValues(..)) => {
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
            let mut keys = Vec::with_capacity(reused.len());
            let mut values = Vec::with_capacity(reused.len());
            for row in reused {
                let (length, k, v) = match row {
                    Some((length, layers)) => match &layers[l] {
                        LayerSequence::KeysValues(k, v) => (*length, Some(k), Some(v)),
                        LayerSequence::State(..) => {
                            candle_core::bail!("a state cached for attention layer {l}")
                        }
                    },
                    None => (0, None, None),
                };
                let zeros = Tensor::zeros(shape(width - length), model.dtype(), model.device())?;
                let aligned = |part: Option<&Tensor>| match part {
                    Some(part) if length < width => Tensor::cat(&[&zeros, part], 2),
                    Some(part) => Ok(part.clone()),
                    None => Ok(zeros.clone()),
                };
                keys.push(aligned(k)?);
                values.push(aligned(v)?);
            }
            layer.set(Some((Tensor::cat(&keys, 0)?, Tensor::cat(&values, 0)?)));
        }
        Ok(())
    }

    /// Row `row`'s keys and values at the columns its `key_mask` marks real, per layer
    /// `[1, kv_heads, n, head_dim]`, and its states in linear-attention layers.
    pub fn row(&self, row: usize, key_mask: &[u8]) -> Result<SequenceCache> {
        let columns: Vec<u32> = (0..key_mask.len() as u32)
            .filter(|&column| key_mask[column as usize] != 0)
            .collect();
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
            let columns = Tensor::new(columns.as_slice(), k.device())?;
            let pick = |t: &Tensor| -> Result<Tensor> {
                t.narrow(0, row, 1)?
                    .contiguous()?
                    .index_select(&columns, 2)?
                    .contiguous()
            };
            layers.push(LayerSequence::KeysValues(pick(k)?, pick(v)?));
        }
        Ok(layers)
    }

    /// Adds `other`'s rows after this cache's, right-aligned: the narrower of the two gets zero columns in
    /// front (which the callers' key masks must mark as padding).
    pub fn append_rows(&mut self, other: KvCache) -> Result<()> {
        let (width, other_width) = (self.len(), other.len());
        for (layer, other) in self.layers.iter_mut().zip(other.layers) {
            layer.state = match (layer.state.take(), other.state) {
                (Some((conv, rule)), Some((other_conv, other_rule))) => Some((
                    Tensor::cat(&[conv, other_conv], 0)?,
                    Tensor::cat(&[rule, other_rule], 0)?,
                )),
                (ours, theirs) => ours.or(theirs),
            };
            let joined = match (layer.keys_values.take(), other.keys_values) {
                (None, theirs) => theirs,
                (ours, None) => ours,
                (Some((k, v)), Some((other_k, other_v))) => {
                    let front = |t: Tensor, n: usize| -> Result<Tensor> {
                        if n == 0 {
                            return Ok(t);
                        }
                        let (b, heads, _, dim) = t.dims4()?;
                        let zeros = Tensor::zeros((b, heads, n, dim), t.dtype(), t.device())?;
                        Tensor::cat(&[&zeros, &t], 2)
                    };
                    let pad = other_width.saturating_sub(width);
                    let other_pad = width.saturating_sub(other_width);
                    Some((
                        Tensor::cat(&[front(k, pad)?, front(other_k, other_pad)?], 0)?,
                        Tensor::cat(&[front(v, pad)?, front(other_v, other_pad)?], 0)?,
                    ))
                }
            };
            layer.set(joined);
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
                let kept = k.dim(2)? - columns;
                layer.set(Some((
                    k.narrow(2, columns, kept)?,
                    v.narrow(2, columns, kept)?,
                )));
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
}
