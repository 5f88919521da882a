//! The batch's forward passes: laying a prefill out, running its chunks beside the decoding rows,
//! sampling, and rows joining and leaving the batch.

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use super::engine::Engine;
use super::rows::{Live, Prefill, PromptScores};
use crate::dispatch::Draws;
use crate::draw::{draw, Ask};
use crate::model::{KvCache, Result, Routing, Segment};
use crate::sample::{finish_text, record, step, Drawn, GenerationParams, Row};

/// The smallest vocabulary whose rows are sampled in parallel.
pub(super) const PARALLEL_VOCAB: usize = 16_384;

/// A step's last-position logits (f32), where the engine's [`Draws`] take them.
enum Logits {
    /// `[rows][vocab]`, read back.
    Host(Vec<Vec<f32>>),
    /// `[rows, vocab]` on the model's device.
    Device(Tensor),
}

/// How a live row gets its token this step.
enum Source<'l> {
    /// Drawn on the host from its row of logits.
    Host(&'l [f32]),
    /// Drawn on the device.
    Drawn(Drawn),
}

/// Draws the live rows the device can draw (see [`draw`]); `None` for the others and the rows done.
fn draw_on_device(
    live: &mut [Live],
    slots: &[usize],
    logits: &Tensor,
) -> Result<Vec<Option<Drawn>>> {
    let vocab = logits.dim(1)?;
    let mut asks = Vec::new();
    let mut asked = Vec::with_capacity(live.len());
    for (live, &slot) in live.iter_mut().zip(slots) {
        let row = &mut live.row;
        let here = !row.done && row.draws_on_device(vocab);
        asked.push(here);
        if here {
            let temperature = row.params.temperature;
            let sample = (temperature > 0.0).then(|| (temperature, row.uniform()));
            asks.push(Ask { row: slot, sample });
        }
    }
    let mut drawn = draw(logits, &asks)?.into_iter();
    Ok(asked
        .into_iter()
        .map(|asked| asked.then(|| drawn.next().expect("one draw per ask")))
        .collect())
}

/// The rows of the device's `logits` that the live rows not drawn there (`drawn[i]` is `None`) and not
/// done read, by row.
fn fetch_rows(
    logits: &Tensor,
    live: &[Live],
    slots: &[usize],
    drawn: &[Option<Drawn>],
) -> Result<HashMap<usize, Vec<f32>>> {
    let mut wanted: Vec<u32> = live
        .iter()
        .zip(slots)
        .zip(drawn)
        .filter(|((live, _), drawn)| !live.row.done && drawn.is_none())
        .map(|((_, &slot), _)| slot as u32)
        .collect();
    wanted.sort_unstable();
    wanted.dedup();
    if wanted.is_empty() {
        return Ok(HashMap::new());
    }
    let rows = logits
        .index_select(&Tensor::new(wanted.as_slice(), logits.device())?, 0)?
        .to_vec2::<f32>()?;
    Ok(wanted
        .into_iter()
        .map(|slot| slot as usize)
        .zip(rows)
        .collect())
}

impl Engine<'_> {
    /// Lays the chosen sequences out for prefilling: `[padding | cached tokens | padding | new tokens]`
    /// per slot, each part right-aligned.
    #[allow(clippy::type_complexity)]
    pub(super) fn start_prefill(
        &mut self,
        chosen: Vec<(u64, usize, Vec<u32>, GenerationParams)>,
    ) -> std::result::Result<Prefill, (Vec<Live>, candle_core::Error)> {
        // A slot per distinct prompt and scoring: a scored prompt runs whole, so it shares no slot with
        // the same prompt read from the prefix cache.
        let mut slot_of: HashMap<(Vec<u32>, Option<usize>), usize> = HashMap::new();
        let mut slots = Vec::with_capacity(chosen.len());
        let mut live = Vec::with_capacity(chosen.len());
        let mut reused = Vec::new();
        let mut prompts: Vec<Vec<u32>> = Vec::new();
        let mut scores = Vec::new();
        let mut failure = None;
        for (group, index, prompt, params) in chosen {
            let key = (prompt, params.prompt_logprobs);
            let slot = match slot_of.get(&key) {
                Some(&slot) => slot,
                None => {
                    let slot = prompts.len();
                    let found = match (self.prefix, key.1) {
                        (Some(prefix), None) => prefix
                            .lookup(&key.0, self.model.long_rope_context())
                            .unwrap_or_else(|error| {
                                failure.get_or_insert(error);
                                None
                            }),
                        _ => None,
                    };
                    reused.push(found);
                    scores.push(key.1.map(PromptScores::new));
                    prompts.push(key.0.clone());
                    slot_of.insert(key.clone(), slot);
                    slot
                }
            };
            let prompt = key.0;
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
        let routes = live
            .iter()
            .any(|live| live.row.params.record_routes)
            .then(|| {
                prompts
                    .iter()
                    .map(|prompt| vec![Vec::new(); prompt.len()])
                    .collect()
            });
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
            routes,
            scores,
        })
    }

    /// One forward pass for the running rows' next tokens and the prefill's next chunk together (their
    /// projections and MLPs read the weights once), then sampling: decoding rows go on or leave, and
    /// after a prefill's last chunk its sequences sample their first token and join the batch.
    pub(super) fn forward_step(&mut self) -> Result<()> {
        let (model, ops) = (self.model, self.ops());
        self.rerun_past_original_context()?;
        let decoding = match self.running.is_empty() {
            true => None,
            false => Some(self.decode_inputs()?),
        };
        let chunk = match &self.prefill {
            Some(prefill) => Some(self.chunk_inputs(prefill)?),
            None => None,
        };
        let recording = self
            .running
            .iter()
            .any(|live| live.row.params.record_routes)
            || self.prefill.as_ref().is_some_and(|p| p.routes.is_some());
        let routing = recording.then(Routing::record);
        let mut segments = Vec::with_capacity(2);
        if let Some((input_ids, positions, key_mask)) = &decoding {
            segments.push(Segment {
                input_ids: input_ids.clone(),
                positions: positions.clone(),
                key_mask: key_mask.clone(),
                cache: &mut self.cache,
                lengths: None,
            });
        }
        if let (Some(prefill), Some((input_ids, positions, key_mask, lengths, _))) =
            (self.prefill.as_mut(), &chunk)
        {
            segments.push(Segment {
                input_ids: input_ids.clone(),
                positions: positions.clone(),
                key_mask: key_mask.clone(),
                cache: &mut prefill.cache,
                lengths: Some(lengths.clone()),
            });
        }
        if segments.is_empty() {
            return Ok(());
        }
        let tokens: usize = segments
            .iter()
            .map(|segment| segment.input_ids.elem_count())
            .sum();
        let mut hidden = model
            .forward_segments_routed(&mut segments, ops, routing.as_ref())?
            .into_iter();
        if let Some(routing) = routing {
            self.keep_routes(
                routing.taken().per_token(tokens),
                chunk.as_ref().map(|c| c.4),
            );
        }
        if decoding.is_some() {
            let hidden = hidden.next().expect("one output per segment");
            self.finish_decode(&hidden)?;
        }
        if let Some((.., columns)) = chunk {
            let hidden = hidden.next().expect("one output per segment");
            self.finish_chunk(&hidden, columns)?;
        }
        self.trim_windows()
    }

    /// LongRoPE: a running row about to feed the first position past the original context runs its
    /// whole sequence again with the long factors, as transformers' `generate` does at that token
    /// (Phi-3's `prepare_inputs_for_generation` drops the cache there): its keys and values so far were
    /// computed with the short factors, and from this token on its logits are those of one forward
    /// pass over its sequence so far. The row leaves the batch, runs alone (in chunks of
    /// `max_num_batched_tokens`), samples its next token and joins again.
    fn rerun_past_original_context(&mut self) -> Result<()> {
        let Some(original) = self.model.long_rope_context() else {
            return Ok(());
        };
        let crossing = |live: &Live| live.row.fed.len() == original;
        if !self.running.iter().any(crossing) {
            return Ok(());
        }
        let (model, ops, device) = (self.model, self.ops(), self.model.device());
        let kept: Vec<u32> = (0..self.running.len() as u32)
            .filter(|&i| !crossing(&self.running[i as usize]))
            .collect();
        let (rerun, running): (Vec<Live>, Vec<Live>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(crossing);
        self.running = running;
        match self.running.is_empty() {
            true => self.cache = KvCache::new(&model.config),
            false => self
                .cache
                .select_rows(&Tensor::new(kept.as_slice(), device)?)?,
        }
        self.drop_shared_padding();
        for mut live in rerun {
            let token = live.row.unfed();
            live.row.fed.push(token);
            let length = live.row.fed.len();
            let mut cache = KvCache::new(&model.config);
            let chunk = self.limits.max_num_batched_tokens;
            let mut last = None;
            for start in (0..length).step_by(chunk) {
                let columns = chunk.min(length - start);
                let ids = live.row.fed[start..start + columns].to_vec();
                let positions: Vec<u32> = (start as u32..(start + columns) as u32).collect();
                let mut segment = [Segment {
                    input_ids: Tensor::from_vec(ids, (1, columns), device)?,
                    positions: Tensor::from_vec(positions, (1, columns), device)?,
                    key_mask: Tensor::ones((1, start + columns), DType::U8, device)?,
                    cache: &mut cache,
                    lengths: Some(vec![length]),
                }];
                let hidden = model.forward_segments(&mut segment, ops)?.pop();
                cache.trim(&[&vec![1; start + columns]])?;
                last = hidden.map(|hidden| (hidden, columns));
            }
            let (hidden, columns) = last.expect("a sequence has tokens");
            live.row.key_mask = vec![1; length];
            self.prefilled += length;
            let logits = self.last_logits(&hidden, columns)?;
            let mut live = vec![live];
            self.sample(&mut live, &[0], &logits)?;
            let kept = self.retire(live, &mut cache)?;
            self.join(kept, cache);
        }
        Ok(())
    }

    /// Lets the windowed layers of the running batch's cache, and of the prefill's, drop the columns no
    /// row can read any more ([`KvCache::trim`]): a long sequence holds about a window of keys there.
    fn trim_windows(&mut self) -> Result<()> {
        let masks: Vec<&[u8]> = self
            .running
            .iter()
            .map(|live| live.row.key_mask.as_slice())
            .collect();
        self.cache.trim(&masks)?;
        if let Some(prefill) = self.prefill.as_mut() {
            let seen = prefill.cached_width + prefill.done;
            let masks: Vec<&[u8]> = prefill.masks.iter().map(|mask| &mask[..seen]).collect();
            prefill.cache.trim(&masks)?;
        }
        Ok(())
    }

    /// Files a pass's routes (one per token, the decoding rows' then the prefill chunk's of `columns`
    /// columns per slot) under the tokens they routed: each decoding row's last fed token, each prompt
    /// position of the chunk.
    fn keep_routes(&mut self, routes: Vec<Vec<u32>>, columns: Option<usize>) {
        let mut routes = routes.into_iter();
        for live in &mut self.running {
            let token = routes.next().unwrap_or_default();
            if live.row.params.record_routes {
                live.row.routes.push(token);
            }
        }
        let (Some(prefill), Some(columns)) = (self.prefill.as_mut(), columns) else {
            return;
        };
        let Some(slots) = prefill.routes.as_mut() else {
            return;
        };
        for (slot, kept) in slots.iter_mut().enumerate() {
            for column in prefill.done..prefill.done + columns {
                let token = routes.next().unwrap_or_default();
                // Real new tokens are where the slot's mask is 1 past the cached columns; their
                // positions count from the start of the prompt.
                if prefill.masks[slot][prefill.cached_width + column] == 1 {
                    let position = prefill.positions[slot * prefill.width + column] as usize;
                    if let Some(place) = kept.get_mut(position) {
                        *place = token;
                    }
                }
            }
        }
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

    /// The prefill's next chunk: inputs `[slots, columns]`, positions, key mask, each slot's whole
    /// prompt length (which picks LongRoPE's factors for every chunk, see [`Segment::lengths`]), and
    /// `columns`.
    #[allow(clippy::type_complexity)]
    fn chunk_inputs(
        &self,
        prefill: &Prefill,
    ) -> Result<(Tensor, Tensor, Tensor, Vec<usize>, usize)> {
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
        // A slot's last column is its prompt's last token.
        let lengths = prefill
            .positions
            .chunks(width)
            .map(|slot| slot[width - 1] as usize + 1)
            .collect();
        Ok((
            Tensor::from_vec(take(&prefill.ids), (slots, columns), device)?,
            Tensor::from_vec(take(&prefill.positions), (slots, columns), device)?,
            Tensor::from_vec(mask, (slots, seen), device)?,
            lengths,
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
        let mut prefill = self.prefill.take().expect("a prefill ran");
        let seen = prefill.cached_width + prefill.done;
        self.prefilled += prefill
            .masks
            .iter()
            .map(|mask| {
                mask[seen..seen + columns]
                    .iter()
                    .filter(|&&m| m == 1)
                    .count()
            })
            .sum::<usize>();
        let scored = self.score_chunk(&mut prefill, hidden, columns);
        prefill.done += columns;
        let complete = prefill.done == prefill.width;
        if !complete || scored.is_err() {
            // A failed pass fails the rows the engine holds: this one's too.
            self.prefill = Some(prefill);
            return scored;
        }
        let Prefill {
            mut live,
            slots,
            masks,
            mut cache,
            routes,
            scores,
            ..
        } = prefill;
        for (live, &slot) in live.iter().zip(&slots) {
            if let Some(scores) = &scores[slot] {
                let group = self
                    .groups
                    .get_mut(&live.group)
                    .expect("a live row's group");
                group.listener.prompt_logprobs(
                    live.row.index,
                    &scores.logprobs,
                    &scores.ranks,
                    &scores.top_logprobs,
                );
            }
        }
        if let Some(routes) = &routes {
            for (live, &slot) in live.iter_mut().zip(&slots) {
                if live.row.params.record_routes {
                    live.row.routes = routes[slot].clone();
                }
            }
        }
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

    /// The f32 logits at the last of `width` positions, where the engine draws from them.
    fn last_logits(&self, hidden: &Tensor, width: usize) -> Result<Logits> {
        let last = hidden.narrow(1, width - 1, 1)?.squeeze(1)?;
        let logits = self.model.logits(&last, self.ops())?.to_dtype(DType::F32)?;
        Ok(match self.draws {
            Draws::Host => Logits::Host(logits.to_vec2::<f32>()?),
            Draws::Device => Logits::Device(logits),
        })
    }

    /// Samples a token for each row from row `slots[i]` of the logits and tells its listener.
    fn sample(&mut self, live: &mut [Live], slots: &[usize], logits: &Logits) -> Result<()> {
        let stopping = &self.stopping;
        let fetched;
        let (vocab, sources): (usize, Vec<Option<Source>>) = match logits {
            Logits::Host(rows) => {
                let sources = live
                    .iter()
                    .zip(slots)
                    .map(|(live, &slot)| (!live.row.done).then(|| Source::Host(&rows[slot])))
                    .collect();
                (self.model.config.vocab_size, sources)
            }
            Logits::Device(tensor) => {
                let drawn = draw_on_device(live, slots, tensor)?;
                fetched = fetch_rows(tensor, live, slots, &drawn)?;
                let sources = live
                    .iter()
                    .zip(slots)
                    .zip(drawn)
                    .map(|((live, slot), drawn)| match (live.row.done, drawn) {
                        (true, _) => None,
                        (false, Some(drawn)) => Some(Source::Drawn(drawn)),
                        (false, None) => Some(Source::Host(fetched[slot].as_slice())),
                    })
                    .collect();
                (tensor.dim(1)?, sources)
            }
        };
        let step_row = |(live, source): (&mut Live, Option<Source>)| match source {
            None => Ok(None),
            Some(Source::Host(logits)) => step(&mut live.row, logits, stopping).map(Some),
            Some(Source::Drawn(drawn)) => record(&mut live.row, drawn, None, stopping).map(Some),
        };
        // Rows sample independently (each with its own generator): over 150k-token vocabularies this
        // is a good part of a decoding step on the host, worth sharing out.
        let sampled: Vec<Option<(u32, f32)>> = if vocab >= PARALLEL_VOCAB {
            live.par_iter_mut()
                .zip(sources.into_par_iter())
                .map(step_row)
                .collect::<Result<_>>()?
        } else {
            live.iter_mut()
                .zip(sources)
                .map(step_row)
                .collect::<Result<_>>()?
        };
        for (live, sampled) in live.iter_mut().zip(sampled) {
            if let Some((token, logprob)) = sampled {
                let group = self
                    .groups
                    .get_mut(&live.group)
                    .expect("a live row's group");
                let top = match live.row.params.top_logprobs {
                    0 => &[][..],
                    _ => live
                        .row
                        .generation
                        .top_logprobs
                        .last()
                        .map_or(&[][..], Vec::as_slice),
                };
                if !group.listener.token(live.row.index, token, logprob, top) {
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
            live.row.generation.routes = std::mem::take(&mut live.row.routes);
            self.end(live, Ok(()));
        }
        if !kept.is_empty() {
            cache.select_rows(&Tensor::new(keep.as_slice(), self.model.device())?)?;
        }
        Ok(kept)
    }

    /// Adds rows (and their cache) to the running batch, right-aligning both sides' columns.
    pub(super) fn join(&mut self, rows: Vec<Live>, cache: KvCache) {
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
    pub(super) fn drop_shared_padding(&mut self) {
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
}
