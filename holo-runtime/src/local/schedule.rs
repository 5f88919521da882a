//! Continuous batching for the local model: sequences join the running batch and leave it at every
//! decoding step, as vLLM, TGI and llama.cpp's server schedule.
//!
//! The engine holds *submissions* (one [`Sampler`](crate::Sampler) call: a Loom request, the `n`
//! samples of one HTTP request), each a group of sequences, and advances all of them one step at a time:
//! 1. **Fair shares.** A free place in the batch goes to the submission with the fewest sequences
//!    admitted (the oldest among equals), so a request with `n` = 4096 advances beside the others
//!    instead of owning the model. When the batch is full and a submission has nothing admitted, the
//!    submission with the most sequences admitted (at least two) gives one back: the sequence is paused
//!    with its keys and values, and resumes where it stopped, without running anything again.
//! 2. **Admission**, while no prefill is in progress: sequences join a prefill while the batch holds
//!    fewer than [`Limits::max_num_seqs`], the prefill's padded tokens stay within
//!    [`Limits::max_num_batched_tokens`], and the keys and values of the batch would stay within
//!    [`Limits::kv_budget_bytes`] (a budget for admission: running sequences are never stopped for it).
//!    Prompts that extend a sequence in the [`PrefixCache`] only run their new tokens, and identical
//!    prompts admitted together (the `G` rollouts of a GRPO group) run once.
//! 3. **Chunked prefill**: a prefill runs at most `max_num_batched_tokens` tokens a step, so a long
//!    prompt does not stall the decoding of the others; when its last chunk has run, its sequences
//!    sample their first token and join the running batch.
//! 4. **Decoding**: one token for every running sequence; sequences that end leave (into the prefix
//!    cache), and their submission hears of it when its last sequence has ended.
//!
//! A sequence's tokens depend only on its prompt, its parameters and its seed, not on what else is in
//! the batch (up to floating-point rounding of the batched products, far below sampling's resolution).
//!
//! Each [`LocalModel`](super::LocalModel) runs one engine on its own thread, started by its first sample:
//! every caller's submissions share the batch. [`LocalModel::scheduler_stats`](super::LocalModel::scheduler_stats)
//! says what it is doing.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use candle_core::{DType, Tensor};
use rayon::prelude::*;
use tokio::sync::oneshot;

use super::generate::{
    finish_text, step, Generation, GenerationParams, PrefixCache, Row, Stopping,
};
use super::model::{KvCache, Model, Ops, Result, Segment, SequenceCache};
use super::Core;
use crate::sampler::TokenSink;

/// How much the engine takes on at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Sequences in the batch (prefilling or decoding) at most.
    pub max_num_seqs: usize,
    /// Tokens one prefill runs per step at most (padding included); a prompt longer than this is
    /// prefilled over several steps.
    pub max_num_batched_tokens: usize,
    /// Keys and values of the batch, in bytes, beyond which no sequence is admitted (one always is when
    /// nothing runs); `usize::MAX` for none.
    pub kv_budget_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            kv_budget_bytes: usize::MAX,
        }
    }
}

/// Whoever waits for a submission's sequences.
pub(super) trait Listener {
    /// Sequence `index` sampled `token`; whether it still wants tokens.
    fn token(&mut self, index: usize, token: u32, logprob: f32) -> bool;
    /// Whether sequence `index`, not admitted yet, is still wanted.
    fn wanted(&self, index: usize) -> bool;
}

/// A submission's results, in sequence order: a generation, or why the model failed it.
pub(super) type Results = Vec<std::result::Result<Generation, String>>;

enum Waiting {
    New {
        index: usize,
        prompt: Vec<u32>,
        params: GenerationParams,
    },
    /// Given back for a fairer share, with the keys and values of the tokens it has run.
    Paused {
        row: Box<Row>,
        layers: SequenceCache,
    },
}

struct Group<'a> {
    listener: Box<dyn Listener + 'a>,
    waiting: VecDeque<Waiting>,
    /// Sequences prefilling or running.
    admitted: usize,
    results: Vec<Option<std::result::Result<Generation, String>>>,
    unfinished: usize,
}

impl Group<'_> {
    /// Sequence `index` has its result.
    fn end(&mut self, index: usize, result: std::result::Result<Generation, String>) {
        self.results[index] = Some(result);
        self.unfinished -= 1;
    }
}

/// A row of the batch and the submission it belongs to.
struct Live {
    group: u64,
    row: Row,
}

/// Sequences prefilled together: their new tokens right-aligned in one padded width, run a chunk of
/// columns at a time. Identical prompts share one row of the forward pass (a *slot*).
struct Prefill {
    live: Vec<Live>,
    /// Each live row's slot.
    slots: Vec<usize>,
    /// Per slot, `width` new tokens (padding first) and their positions.
    ids: Vec<u32>,
    positions: Vec<u32>,
    /// Per slot, the key mask over the cached columns and the `width` new ones.
    masks: Vec<Vec<u8>>,
    cached_width: usize,
    width: usize,
    /// Columns of `width` already run.
    done: usize,
    cache: KvCache,
}

/// The scheduler's state; see the [module documentation](self).
pub(super) struct Engine<'a> {
    model: &'a Model,
    stopping: Stopping<'a>,
    prefix: Option<&'a PrefixCache>,
    limits: Limits,
    /// By arrival.
    groups: BTreeMap<u64, Group<'a>>,
    next_group: u64,
    running: Vec<Live>,
    cache: KvCache,
    prefill: Option<Prefill>,
}

/// The smallest vocabulary whose rows are sampled in parallel.
const PARALLEL_VOCAB: usize = 16_384;

impl<'a> Engine<'a> {
    pub(super) fn new(
        model: &'a Model,
        stopping: Stopping<'a>,
        prefix: Option<&'a PrefixCache>,
        limits: Limits,
    ) -> Self {
        Engine {
            model,
            stopping,
            prefix,
            limits: Limits {
                max_num_seqs: limits.max_num_seqs.max(1),
                max_num_batched_tokens: limits.max_num_batched_tokens.max(1),
                ..limits
            },
            groups: BTreeMap::new(),
            next_group: 0,
            running: Vec::new(),
            cache: KvCache::new(&model.config),
            prefill: None,
        }
    }

    /// Queues a submission; its id, which [`Engine::step`] returns with its results once every sequence
    /// has ended. Prompts must be non-empty.
    pub(super) fn submit(
        &mut self,
        sequences: Vec<(Vec<u32>, GenerationParams)>,
        listener: Box<dyn Listener + 'a>,
    ) -> u64 {
        let id = self.next_group;
        self.next_group += 1;
        let count = sequences.len();
        self.groups.insert(
            id,
            Group {
                listener,
                waiting: sequences
                    .into_iter()
                    .enumerate()
                    .map(|(index, (prompt, params))| Waiting::New {
                        index,
                        prompt,
                        params,
                    })
                    .collect(),
                admitted: 0,
                results: (0..count).map(|_| None).collect(),
                unfinished: count,
            },
        );
        id
    }

    /// Whether nothing is queued or running.
    pub(super) fn is_idle(&self) -> bool {
        self.groups.is_empty()
    }

    /// Sequences not admitted yet.
    pub(super) fn waiting(&self) -> usize {
        self.groups.values().map(|group| group.waiting.len()).sum()
    }

    /// Sequences prefilling or decoding.
    pub(super) fn running(&self) -> usize {
        self.running.len()
            + self
                .prefill
                .as_ref()
                .map_or(0, |prefill| prefill.live.len())
    }

    /// Bytes of keys and values the batch holds (padding included).
    pub(super) fn kv_bytes(&self) -> usize {
        let prefilling = self.prefill.as_ref().map_or(0, |prefill| {
            prefill.masks.len() * (prefill.cached_width + prefill.done)
        });
        (self.running.len() * self.cache.len() + prefilling) * self.kv_bytes_per_token()
    }

    fn kv_bytes_per_token(&self) -> usize {
        let config = &self.model.config;
        config.num_hidden_layers
            * 2
            * config.num_key_value_heads
            * config.head_dim
            * self.model.dtype().size_in_bytes()
    }

    /// One scheduling step: admissions, a prefill chunk, a decoding step. Returns the submissions
    /// whose last sequence ended.
    pub(super) fn step(&mut self) -> Vec<(u64, Results)> {
        self.make_room();
        if self.prefill.is_none() {
            self.admit();
        }
        if let Err(error) = self.forward_step() {
            // The pass failed: every sequence in it fails, those it had in hand too.
            let mut failed = std::mem::take(&mut self.running);
            failed.extend(
                self.prefill
                    .take()
                    .map(|prefill| prefill.live)
                    .unwrap_or_default(),
            );
            self.cache = KvCache::new(&self.model.config);
            self.fail(failed, &error);
            self.fail_lost(&error);
        }
        let ended: Vec<u64> = self
            .groups
            .iter()
            .filter(|(_, group)| group.unfinished == 0)
            .map(|(&id, _)| id)
            .collect();
        ended
            .into_iter()
            .map(|id| {
                let group = self.groups.remove(&id).expect("listed");
                let results = group
                    .results
                    .into_iter()
                    .map(|result| result.expect("every sequence ended"))
                    .collect();
                (id, results)
            })
            .collect()
    }

    /// Fails every submission (after a panic: nothing the engine holds can be trusted).
    pub(super) fn fail_all(&mut self, error: &str) -> Vec<(u64, Results)> {
        std::mem::take(&mut self.groups)
            .into_iter()
            .map(|(id, group)| (id, vec![Err(error.to_string()); group.results.len()]))
            .collect()
    }

    /// Pauses a sequence of the submission with the most admitted when the batch is full and some
    /// submission has none.
    fn make_room(&mut self) {
        if self.prefill.is_some() || self.running.len() < self.limits.max_num_seqs {
            return;
        }
        let starving = self
            .groups
            .values()
            .any(|group| group.admitted == 0 && !group.waiting.is_empty());
        if !starving {
            return;
        }
        let Some((&victim, group)) = self
            .groups
            .iter()
            .max_by_key(|(&id, group)| (group.admitted, std::cmp::Reverse(id)))
        else {
            return;
        };
        if group.admitted < 2 {
            return;
        }
        let Some(i) = self.running.iter().rposition(|live| live.group == victim) else {
            return;
        };
        let paused = self
            .cache
            .row(i, &self.running[i].row.key_mask)
            .and_then(|layers| {
                let kept: Vec<u32> = (0..self.running.len() as u32)
                    .filter(|&r| r as usize != i)
                    .collect();
                self.cache
                    .select_rows(&Tensor::new(kept.as_slice(), self.model.device())?)?;
                Ok(layers)
            });
        // Pausing is an optimisation of fairness: when the cache cannot give the row up, it runs on.
        if let Ok(layers) = paused {
            let live = self.running.remove(i);
            let group = self.groups.get_mut(&victim).expect("a running row's group");
            group.admitted -= 1;
            group.waiting.push_front(Waiting::Paused {
                row: Box::new(live.row),
                layers,
            });
            self.drop_shared_padding();
        }
    }

    /// The submission whose next sequence is admitted next: the fewest admitted, the oldest first.
    fn next_group(&self) -> Option<u64> {
        self.groups
            .iter()
            .filter(|(_, group)| !group.waiting.is_empty())
            .min_by_key(|(&id, group)| (group.admitted, id))
            .map(|(&id, _)| id)
    }

    fn admit(&mut self) {
        let per_token = self.kv_bytes_per_token();
        let mut chosen: Vec<(u64, usize, Vec<u32>, GenerationParams)> = Vec::new();
        let mut distinct = HashSet::new();
        let mut width = 0;
        while self.running.len() + chosen.len() < self.limits.max_num_seqs {
            let Some(id) = self.next_group() else { break };
            let group = self.groups.get_mut(&id).expect("listed");
            match group
                .waiting
                .front()
                .expect("a group with waiting sequences")
            {
                Waiting::Paused { row, .. } => {
                    let columns = self.cache.len().max(row.fed.len());
                    let projected = (self.running.len() + 1) * columns * per_token;
                    if !self.running.is_empty() && projected > self.limits.kv_budget_bytes {
                        break;
                    }
                    let Some(Waiting::Paused { row, layers }) = group.waiting.pop_front() else {
                        unreachable!("the front was paused")
                    };
                    group.admitted += 1;
                    let mut row = *row;
                    row.key_mask = vec![1; row.fed.len()];
                    let mut cache = KvCache::new(&self.model.config);
                    let length = row.fed.len();
                    let resumed = cache
                        .prefill(&[Some((length, layers))], length, self.model)
                        .map(|()| cache);
                    match resumed {
                        Ok(cache) => self.join(vec![Live { group: id, row }], cache),
                        Err(error) => self.fail(vec![Live { group: id, row }], &error),
                    }
                }
                Waiting::New {
                    index,
                    prompt,
                    params,
                } => {
                    if params.max_tokens == 0 || !group.listener.wanted(*index) {
                        let (index, prompt, params) = pop_new(&mut group.waiting);
                        group.end(index, Ok(Row::new(index, prompt, params).generation));
                        continue;
                    }
                    let new_width = width.max(prompt.len());
                    let slots =
                        distinct.len() + usize::from(!distinct.contains(&fingerprint(prompt)));
                    if !chosen.is_empty() && slots * new_width > self.limits.max_num_batched_tokens
                    {
                        break;
                    }
                    let projected = (self.running.len() + chosen.len() + 1)
                        * self.cache.len().max(new_width)
                        * per_token;
                    if (!self.running.is_empty() || !chosen.is_empty())
                        && projected > self.limits.kv_budget_bytes
                    {
                        break;
                    }
                    let (index, prompt, params) = pop_new(&mut group.waiting);
                    group.admitted += 1;
                    distinct.insert(fingerprint(&prompt));
                    width = new_width;
                    chosen.push((id, index, prompt, params));
                }
            }
        }
        if chosen.is_empty() {
            return;
        }
        match self.start_prefill(chosen) {
            Ok(prefill) => self.prefill = Some(prefill),
            Err((live, error)) => self.fail(live, &error),
        }
    }

    /// Lays the chosen sequences out for prefilling: `[padding | cached tokens | padding | new tokens]`
    /// per slot, each part right-aligned.
    #[allow(clippy::type_complexity)]
    fn start_prefill(
        &mut self,
        chosen: Vec<(u64, usize, Vec<u32>, GenerationParams)>,
    ) -> std::result::Result<Prefill, (Vec<Live>, candle_core::Error)> {
        let mut slot_of: HashMap<Vec<u32>, usize> = HashMap::new();
        let mut slots = Vec::with_capacity(chosen.len());
        let mut live = Vec::with_capacity(chosen.len());
        let mut reused = Vec::new();
        let mut prompts: Vec<Vec<u32>> = Vec::new();
        let mut failure = None;
        for (group, index, prompt, params) in chosen {
            let slot = match slot_of.get(&prompt) {
                Some(&slot) => slot,
                None => {
                    let slot = prompts.len();
                    let found = match self.prefix {
                        Some(prefix) => prefix.lookup(&prompt).unwrap_or_else(|error| {
                            failure.get_or_insert(error);
                            None
                        }),
                        None => None,
                    };
                    reused.push(found);
                    prompts.push(prompt.clone());
                    slot_of.insert(prompt.clone(), slot);
                    slot
                }
            };
            slots.push(slot);
            live.push(Live {
                group,
                row: Row::new(index, prompt, params),
            });
        }
        if let Some(error) = failure {
            return Err((live, error));
        }
        let lengths: Vec<usize> = reused
            .iter()
            .map(|reused| reused.as_ref().map_or(0, |(length, _)| *length))
            .collect();
        let cached_width = lengths.iter().copied().max().unwrap_or(0);
        let width = prompts
            .iter()
            .zip(&lengths)
            .map(|(prompt, length)| prompt.len() - length)
            .max()
            .unwrap_or(0);
        let pad = self.stopping.eos.first().copied().unwrap_or(0);
        let mut ids = Vec::with_capacity(prompts.len() * width);
        let mut positions = Vec::with_capacity(prompts.len() * width);
        let mut masks = Vec::with_capacity(prompts.len());
        for (prompt, &length) in prompts.iter().zip(&lengths) {
            let new = &prompt[length..];
            let padding = width - new.len();
            ids.extend(std::iter::repeat_n(pad, padding));
            ids.extend_from_slice(new);
            positions.extend(std::iter::repeat_n(0u32, padding));
            positions.extend((length..prompt.len()).map(|p| p as u32));
            let mut mask = vec![0u8; cached_width - length];
            mask.resize(cached_width, 1);
            mask.resize(cached_width + padding, 0);
            mask.resize(cached_width + width, 1);
            masks.push(mask);
        }
        let mut cache = KvCache::new(&self.model.config);
        if cached_width > 0 {
            if let Err(error) = cache.prefill(&reused, cached_width, self.model) {
                return Err((live, error));
            }
        }
        Ok(Prefill {
            live,
            slots,
            ids,
            positions,
            masks,
            cached_width,
            width,
            done: 0,
            cache,
        })
    }

    /// One forward pass for the running rows' next tokens and the prefill's next chunk together (their
    /// projections and MLPs read the weights once), then sampling: decoding rows go on or leave, and
    /// after a prefill's last chunk its sequences sample their first token and join the batch.
    fn forward_step(&mut self) -> Result<()> {
        let model = self.model;
        let decoding = match self.running.is_empty() {
            true => None,
            false => Some(self.decode_inputs()?),
        };
        let chunk = match &self.prefill {
            Some(prefill) => Some(self.chunk_inputs(prefill)?),
            None => None,
        };
        let mut segments = Vec::with_capacity(2);
        if let Some((input_ids, positions, key_mask)) = &decoding {
            segments.push(Segment {
                input_ids: input_ids.clone(),
                positions: positions.clone(),
                key_mask: key_mask.clone(),
                cache: &mut self.cache,
            });
        }
        if let (Some(prefill), Some((input_ids, positions, key_mask, _))) =
            (self.prefill.as_mut(), &chunk)
        {
            segments.push(Segment {
                input_ids: input_ids.clone(),
                positions: positions.clone(),
                key_mask: key_mask.clone(),
                cache: &mut prefill.cache,
            });
        }
        if segments.is_empty() {
            return Ok(());
        }
        let mut hidden = model.forward_segments(&mut segments)?.into_iter();
        if decoding.is_some() {
            let hidden = hidden.next().expect("one output per segment");
            self.finish_decode(&hidden)?;
        }
        if let Some((.., columns)) = chunk {
            let hidden = hidden.next().expect("one output per segment");
            self.finish_chunk(&hidden, columns)?;
        }
        Ok(())
    }

    /// Feeds every running row its last sampled token: the inputs `[rows, 1]`, positions and key mask.
    fn decode_inputs(&mut self) -> Result<(Tensor, Tensor, Tensor)> {
        let device = self.model.device();
        let rows = self.running.len();
        let mut next = Vec::with_capacity(rows);
        let mut positions = Vec::with_capacity(rows);
        for live in &mut self.running {
            let token = live.row.unfed();
            positions.push(live.row.fed.len() as u32);
            live.row.fed.push(token);
            live.row.key_mask.push(1);
            next.push(token);
        }
        let columns = self.running[0].row.key_mask.len();
        let mask: Vec<u8> = self
            .running
            .iter()
            .flat_map(|live| live.row.key_mask.iter().copied())
            .collect();
        Ok((
            Tensor::from_vec(next, (rows, 1), device)?,
            Tensor::from_vec(positions, (rows, 1), device)?,
            Tensor::from_vec(mask, (rows, columns), device)?,
        ))
    }

    /// The prefill's next chunk: inputs `[slots, columns]`, positions, key mask, and `columns`.
    fn chunk_inputs(&self, prefill: &Prefill) -> Result<(Tensor, Tensor, Tensor, usize)> {
        let device = self.model.device();
        let slots = prefill.masks.len();
        let chunk = (self.limits.max_num_batched_tokens / slots).max(1);
        let columns = chunk.min(prefill.width - prefill.done);
        let (start, width) = (prefill.done, prefill.width);
        let take = |values: &[u32]| -> Vec<u32> {
            values
                .chunks(width)
                .flat_map(|slot| slot[start..start + columns].iter().copied())
                .collect()
        };
        let seen = prefill.cached_width + start + columns;
        let mask: Vec<u8> = prefill
            .masks
            .iter()
            .flat_map(|mask| mask[..seen].iter().copied())
            .collect();
        Ok((
            Tensor::from_vec(take(&prefill.ids), (slots, columns), device)?,
            Tensor::from_vec(take(&prefill.positions), (slots, columns), device)?,
            Tensor::from_vec(mask, (slots, seen), device)?,
            columns,
        ))
    }

    /// Samples the running rows' next tokens from their hidden states `[rows, 1, hidden]`.
    fn finish_decode(&mut self, hidden: &Tensor) -> Result<()> {
        let logits = self.last_logits(hidden, 1)?;
        let mut running = std::mem::take(&mut self.running);
        let identity: Vec<usize> = (0..running.len()).collect();
        self.sample(&mut running, &identity, &logits)?;
        let mut cache = std::mem::replace(&mut self.cache, KvCache::new(&self.model.config));
        self.running = self.retire(running, &mut cache)?;
        if !self.running.is_empty() {
            self.cache = cache;
        }
        self.drop_shared_padding();
        Ok(())
    }

    /// Counts the chunk the prefill ran; after its last, its sequences sample from the hidden states
    /// `[slots, columns, hidden]` and join the batch.
    fn finish_chunk(&mut self, hidden: &Tensor, columns: usize) -> Result<()> {
        let prefill = self.prefill.as_mut().expect("a prefill ran");
        prefill.done += columns;
        if prefill.done < prefill.width {
            return Ok(());
        }
        let Prefill {
            mut live,
            slots,
            masks,
            mut cache,
            ..
        } = self.prefill.take().expect("checked");
        let logits = self.last_logits(hidden, columns)?;
        if slots.iter().enumerate().any(|(i, &slot)| i != slot) {
            let rows: Vec<u32> = slots.iter().map(|&slot| slot as u32).collect();
            cache.select_rows(&Tensor::new(rows.as_slice(), self.model.device())?)?;
        }
        for (live, &slot) in live.iter_mut().zip(&slots) {
            live.row.key_mask = masks[slot].clone();
        }
        self.sample(&mut live, &slots, &logits)?;
        let kept = self.retire(live, &mut cache)?;
        self.join(kept, cache);
        Ok(())
    }

    /// The f32 logits `[rows][vocab]` at the last of `width` positions.
    fn last_logits(&self, hidden: &Tensor, width: usize) -> Result<Vec<Vec<f32>>> {
        let last = hidden.narrow(1, width - 1, 1)?.squeeze(1)?;
        self.model
            .logits(&last, Ops::Fast)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()
    }

    /// Samples a token for each row from `logits[slots[i]]` and tells its listener.
    fn sample(&mut self, live: &mut [Live], slots: &[usize], logits: &[Vec<f32>]) -> Result<()> {
        let stopping = &self.stopping;
        let step_row = |(live, &slot): (&mut Live, &usize)| match live.row.done {
            true => Ok(None),
            false => step(&mut live.row, &logits[slot], stopping).map(Some),
        };
        // Rows sample independently (each with its own generator): over 150k-token vocabularies this
        // is a good part of a decoding step, worth sharing out.
        let sampled: Vec<Option<(u32, f32)>> = if self.model.config.vocab_size >= PARALLEL_VOCAB {
            live.par_iter_mut()
                .zip(slots.par_iter())
                .map(step_row)
                .collect::<Result<_>>()?
        } else {
            live.iter_mut()
                .zip(slots.iter())
                .map(step_row)
                .collect::<Result<_>>()?
        };
        for (live, sampled) in live.iter_mut().zip(sampled) {
            if let Some((token, logprob)) = sampled {
                let group = self
                    .groups
                    .get_mut(&live.group)
                    .expect("a live row's group");
                if !group.listener.token(live.row.index, token, logprob) {
                    live.row.done = true;
                }
            }
        }
        Ok(())
    }

    /// Ends the rows that are done (their sequence into the prefix cache, their generation to their
    /// submission) and keeps the others, in `cache` too.
    fn retire(&mut self, live: Vec<Live>, cache: &mut KvCache) -> Result<Vec<Live>> {
        if live.iter().all(|live| !live.row.done) {
            return Ok(live);
        }
        let keep: Vec<u32> = (0..live.len() as u32)
            .filter(|&i| !live[i as usize].row.done)
            .collect();
        let mut kept = Vec::with_capacity(keep.len());
        for (i, mut live) in live.into_iter().enumerate() {
            if !live.row.done {
                kept.push(live);
                continue;
            }
            if let Some(prefix) = self.prefix {
                let layers = cache.row(i, &live.row.key_mask)?;
                prefix.insert(std::mem::take(&mut live.row.fed), layers);
            }
            finish_text(&mut live.row, &self.stopping)?;
            self.end(live, Ok(()));
        }
        if !kept.is_empty() {
            cache.select_rows(&Tensor::new(keep.as_slice(), self.model.device())?)?;
        }
        Ok(kept)
    }

    /// Adds rows (and their cache) to the running batch, right-aligning both sides' columns.
    fn join(&mut self, rows: Vec<Live>, cache: KvCache) {
        if rows.is_empty() {
            return;
        }
        if self.running.is_empty() {
            self.running = rows;
            self.cache = cache;
            return;
        }
        let (width, joining) = (self.cache.len(), cache.len());
        let pad = |rows: &mut [Live], columns: usize| {
            if columns > 0 {
                for live in rows {
                    live.row
                        .key_mask
                        .splice(0..0, std::iter::repeat_n(0, columns));
                }
            }
        };
        let mut rows = rows;
        pad(&mut self.running, joining.saturating_sub(width));
        pad(&mut rows, width.saturating_sub(joining));
        match self.cache.append_rows(cache) {
            Ok(()) => self.running.extend(rows),
            Err(error) => {
                // The batch's cache is in an unknown state: every row in it fails.
                let mut failed = std::mem::take(&mut self.running);
                failed.extend(rows);
                self.cache = KvCache::new(&self.model.config);
                self.fail(failed, &error);
            }
        }
    }

    /// Drops leading columns that are padding for every running row.
    fn drop_shared_padding(&mut self) {
        let shared = self
            .running
            .iter()
            .map(|live| live.row.key_mask.iter().take_while(|&&m| m == 0).count())
            .min()
            .unwrap_or(0);
        if shared > 0 && self.cache.drop_front(shared).is_ok() {
            for live in &mut self.running {
                live.row.key_mask.drain(..shared);
            }
        }
    }

    /// Fails the admitted sequences that are no longer in the batch (an error left them nowhere).
    fn fail_lost(&mut self, error: &candle_core::Error) {
        for group in self.groups.values_mut() {
            if group.admitted == 0 {
                continue;
            }
            let waiting: HashSet<usize> = group
                .waiting
                .iter()
                .map(|waiting| match waiting {
                    Waiting::New { index, .. } => *index,
                    Waiting::Paused { row, .. } => row.index,
                })
                .collect();
            for (index, result) in group.results.iter_mut().enumerate() {
                if result.is_none() && !waiting.contains(&index) {
                    *result = Some(Err(error.to_string()));
                    group.unfinished -= 1;
                }
            }
            group.admitted = 0;
        }
    }

    fn fail(&mut self, live: Vec<Live>, error: &candle_core::Error) {
        for live in live {
            self.end(live, Err(error.to_string()));
        }
    }

    /// An admitted row has ended: its generation, or why it failed, goes to its submission.
    fn end(&mut self, live: Live, outcome: std::result::Result<(), String>) {
        let group = self
            .groups
            .get_mut(&live.group)
            .expect("a live row's group");
        group.admitted -= 1;
        group.end(live.row.index, outcome.map(|()| live.row.generation));
    }
}

/// Takes the new sequence at the front of a submission's queue.
fn pop_new(waiting: &mut VecDeque<Waiting>) -> (usize, Vec<u32>, GenerationParams) {
    match waiting.pop_front() {
        Some(Waiting::New {
            index,
            prompt,
            params,
        }) => (index, prompt, params),
        _ => unreachable!("the front was a new sequence"),
    }
}

/// A prompt's hash, to count the distinct prompts of an admission.
fn fingerprint(prompt: &[u32]) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    prompt.hash(&mut hasher);
    hasher.finish()
}

// ---------------------------------------------------------------------------------------------------
// The engine on its own thread

/// What the scheduler is doing, for `/metrics` and progress lines.
#[derive(Debug, Default)]
pub struct SchedulerStats {
    waiting: AtomicUsize,
    /// Submitted sequences the engine has not taken from the channel yet.
    in_channel: AtomicUsize,
    running: AtomicUsize,
    kv_bytes: AtomicUsize,
    generated: AtomicUsize,
}

impl SchedulerStats {
    /// Sequences queued, not admitted yet.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed) + self.in_channel.load(Ordering::Relaxed)
    }

    /// Sequences prefilling or decoding.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// Bytes of keys and values the running batch holds.
    pub fn kv_bytes(&self) -> usize {
        self.kv_bytes.load(Ordering::Relaxed)
    }

    /// Tokens sampled since the scheduler started.
    pub fn generated_tokens(&self) -> usize {
        self.generated.load(Ordering::Relaxed)
    }
}

struct Submission {
    sequences: Vec<(Vec<u32>, GenerationParams)>,
    listener: SinkListener,
    done: oneshot::Sender<Results>,
}

/// A [`TokenSink`] as the engine's listener: submission index `i` is the sink's `indices[i]`.
struct SinkListener {
    sink: Arc<dyn TokenSink>,
    indices: Vec<usize>,
    stats: Arc<SchedulerStats>,
}

impl Listener for SinkListener {
    fn token(&mut self, index: usize, token: u32, logprob: f32) -> bool {
        self.stats.generated.fetch_add(1, Ordering::Relaxed);
        self.sink.token(self.indices[index], token, logprob)
    }

    fn wanted(&self, index: usize) -> bool {
        self.sink.wanted(self.indices[index])
    }
}

/// Why a submission was not queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overloaded {
    pub waiting: usize,
    pub max_waiting: usize,
}

/// An [`Engine`] on its own thread, shared by every caller of one [`LocalModel`](super::LocalModel).
/// The thread ends when the scheduler is dropped and its work is done.
pub(super) struct Scheduler {
    submissions: mpsc::Sender<Submission>,
    stats: Arc<SchedulerStats>,
    max_waiting: usize,
}

impl Scheduler {
    pub(super) fn start(core: Arc<Core>, limits: Limits, max_waiting: usize) -> Scheduler {
        let (submissions, receiver) = mpsc::channel::<Submission>();
        let stats = Arc::new(SchedulerStats::default());
        let thread_stats = Arc::clone(&stats);
        std::thread::Builder::new()
            .name("holo-scheduler".into())
            .spawn(move || run(&core, limits, receiver, &thread_stats))
            .expect("the scheduler's thread starts");
        Scheduler {
            submissions,
            stats,
            max_waiting,
        }
    }

    pub(super) fn stats(&self) -> &Arc<SchedulerStats> {
        &self.stats
    }

    /// Queues sequences; `sink` hears of their tokens under `indices[i]` for sequence `i`. The receiver
    /// gets their results once all have ended.
    pub(super) fn submit(
        &self,
        sequences: Vec<(Vec<u32>, GenerationParams)>,
        indices: Vec<usize>,
        sink: Arc<dyn TokenSink>,
    ) -> std::result::Result<oneshot::Receiver<Results>, Overloaded> {
        let count = sequences.len();
        let waiting = self.stats.waiting();
        if waiting + count > self.max_waiting && waiting > 0 {
            return Err(Overloaded {
                waiting,
                max_waiting: self.max_waiting,
            });
        }
        let (done, receiver) = oneshot::channel();
        self.stats.in_channel.fetch_add(count, Ordering::Relaxed);
        let submission = Submission {
            sequences,
            listener: SinkListener {
                sink,
                indices,
                stats: Arc::clone(&self.stats),
            },
            done,
        };
        if let Err(mpsc::SendError(submission)) = self.submissions.send(submission) {
            // The thread is gone (a panic outside a step): the receiver reports it closed.
            self.stats.in_channel.fetch_sub(count, Ordering::Relaxed);
            drop(submission);
        }
        Ok(receiver)
    }
}

fn run(
    core: &Core,
    limits: Limits,
    submissions: mpsc::Receiver<Submission>,
    stats: &SchedulerStats,
) {
    let stopping = Stopping {
        eos: &core.end_of_turn,
        tokenizer: &core.tokenizer,
    };
    let new_engine = || Engine::new(&core.model, stopping, Some(&core.prefix), limits);
    let mut engine = new_engine();
    let mut waiting_for: HashMap<u64, oneshot::Sender<Results>> = HashMap::new();
    let take = |engine: &mut Engine, submission: Submission| {
        // Counted as waiting at once (not at the end of the step), so that a full queue refuses at once.
        let count = submission.sequences.len();
        stats.waiting.fetch_add(count, Ordering::Relaxed);
        stats.in_channel.fetch_sub(count, Ordering::Relaxed);
        let id = engine.submit(submission.sequences, Box::new(submission.listener));
        (id, submission.done)
    };
    loop {
        if engine.is_idle() {
            match submissions.recv() {
                Ok(submission) => {
                    let (id, done) = take(&mut engine, submission);
                    waiting_for.insert(id, done);
                }
                Err(mpsc::RecvError) => return,
            }
        }
        while let Ok(submission) = submissions.try_recv() {
            let (id, done) = take(&mut engine, submission);
            waiting_for.insert(id, done);
        }
        let ended = match catch_unwind(AssertUnwindSafe(|| engine.step())) {
            Ok(ended) => ended,
            Err(_) => {
                let ended = engine.fail_all("the local model panicked");
                engine = new_engine();
                ended
            }
        };
        stats.waiting.store(engine.waiting(), Ordering::Relaxed);
        stats.running.store(engine.running(), Ordering::Relaxed);
        stats.kv_bytes.store(engine.kv_bytes(), Ordering::Relaxed);
        for (id, results) in ended {
            if let Some(done) = waiting_for.remove(&id) {
                let _ = done.send(results);
            }
        }
    }
}
