//! The engine's queues: submissions, fair shares, admission, and the end of sequences.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};

use candle_core::Tensor;

use super::rows::{Live, Prefill};
use super::{Limits, Listener, Results};
use crate::dispatch::{self, Draws};
use crate::model::{state_dtype, trim_block, KvCache, Model, Ops, SequenceCache};
use crate::sample::{Generation, GenerationParams, PrefixCache, Row, Stopping};

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

pub(super) struct Group<'a> {
    pub(super) listener: Box<dyn Listener + 'a>,
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

/// The scheduler's state; see the [module documentation](super).
pub(crate) struct Engine<'a> {
    pub(super) model: &'a Model,
    pub(super) stopping: Stopping<'a>,
    pub(super) prefix: Option<&'a PrefixCache>,
    pub(super) limits: Limits,
    /// By arrival.
    pub(super) groups: BTreeMap<u64, Group<'a>>,
    next_group: u64,
    pub(super) running: Vec<Live>,
    pub(super) cache: KvCache,
    pub(super) prefill: Option<Prefill>,
    /// Where tokens are drawn: the model's device decides ([`dispatch::draws`]).
    pub(super) draws: Draws,
    /// Prompt tokens run through the model since the scheduler last took the count (padding and
    /// cached tokens are not run).
    pub(crate) prefilled: usize,
}

impl<'a> Engine<'a> {
    pub(crate) fn new(
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
            draws: dispatch::draws(model.device().location()),
            prefilled: 0,
        }
    }

    /// The engine drawing its tokens as a model elsewhere would: the CPU's tests of the GPU's way.
    #[cfg(test)]
    pub(crate) fn drawing(mut self, draws: Draws) -> Self {
        self.draws = draws;
        self
    }

    /// The operations sampling passes use: [`Ops::Invariant`] for batch-invariant sampling.
    pub(super) fn ops(&self) -> Ops {
        match self.limits.batch_invariant {
            true => Ops::Invariant,
            false => Ops::Fast,
        }
    }

    /// Queues a submission; its id, which [`Engine::step`] returns with its results once every sequence
    /// has ended. Prompts must be non-empty.
    pub(crate) fn submit(
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
    pub(crate) fn is_idle(&self) -> bool {
        self.groups.is_empty()
    }

    /// Sequences not admitted yet.
    pub(crate) fn waiting(&self) -> usize {
        self.groups.values().map(|group| group.waiting.len()).sum()
    }

    /// Sequences prefilling or decoding.
    pub(crate) fn running(&self) -> usize {
        self.running.len()
            + self
                .prefill
                .as_ref()
                .map_or(0, |prefill| prefill.live.len())
    }

    /// Bytes of keys and values the batch holds (padding and the cache's spare columns included).
    /// Bytes the batch's caches hold: keys and values (with the columns reserved for the next steps),
    /// and each sequence's linear-attention states.
    pub(crate) fn kv_bytes(&self) -> usize {
        self.cache.bytes()
            + self
                .prefill
                .as_ref()
                .map_or(0, |prefill| prefill.cache.bytes())
    }

    /// Keys and values of `columns` columns of one row, over the attention layers (what admission
    /// projects per row): a windowed layer holds no more than its window and a [`trim_block`] of them.
    fn kv_bytes_per_row(model: &Model, columns: usize) -> usize {
        let config = &model.config;
        let held: usize = config
            .layers
            .iter()
            .filter(|layer| !layer.linear)
            .map(|layer| match layer.window {
                Some(window) => columns.min(window + trim_block(window)),
                None => columns,
            })
            .sum();
        held * 2 * config.num_key_value_heads * config.head_dim * model.dtype().size_in_bytes()
    }

    /// The states one sequence keeps in the linear-attention layers, whatever its length: the
    /// convolution's last inputs and the delta rule's state (what admission projects per sequence).
    fn state_bytes_per_row(&self) -> usize {
        let config = &self.model.config;
        let Some(sizes) = config.linear_attention else {
            return 0;
        };
        let linear_layers = config.layers.iter().filter(|layer| layer.linear).count();
        let per_layer = sizes.conv_dim() * (sizes.conv_kernel - 1)
            + sizes.value_heads * sizes.key_head_dim * sizes.value_head_dim;
        linear_layers * per_layer * state_dtype(self.model.dtype()).size_in_bytes()
    }

    /// One scheduling step: admissions, a prefill chunk, a decoding step. Returns the submissions
    /// whose last sequence ended.
    pub(crate) fn step(&mut self) -> Vec<(u64, Results)> {
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
    pub(crate) fn fail_all(&mut self, error: &str) -> Vec<(u64, Results)> {
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
        let (model, per_row) = (self.model, self.state_bytes_per_row());
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
                    let projected = (self.running.len() + 1)
                        * (Self::kv_bytes_per_row(model, columns) + per_row);
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
                    // A prompt to score runs even when nothing is sampled after it.
                    let idle = params.max_tokens == 0 && params.prompt_logprobs.is_none();
                    if idle || !group.listener.wanted(*index) {
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
                        * (Self::kv_bytes_per_row(model, self.cache.len().max(new_width))
                            + per_row);
                    if (!self.running.is_empty() || !chosen.is_empty())
                        && projected > self.limits.kv_budget_bytes
                    {
                        break;
                    }
                    let (index, prompt, params) = pop_new(&mut group.waiting);
                    group.admitted += 1;
                    group.listener.started(index);
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

    pub(super) fn fail(&mut self, live: Vec<Live>, error: &candle_core::Error) {
        for live in live {
            self.end(live, Err(error.to_string()));
        }
    }

    /// An admitted row has ended: its generation, or why it failed, goes to its submission.
    pub(super) fn end(&mut self, live: Live, outcome: std::result::Result<(), String>) {
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

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::*;
    use std::collections::HashMap;

    use crate::config::Arch;
    use crate::init::{preset_config, Preset};
    use crate::sample::Stopping;
    use crate::schedule::Listener;
    use crate::testing::random_model;

    struct Quiet;

    impl Listener for Quiet {
        fn token(&mut self, _: usize, _: u32, _: f32, _: &[(u32, f32)]) -> bool {
            true
        }
        fn wanted(&self, _: usize) -> bool {
            true
        }
    }

    /// What admission projects for a running batch of a hybrid model, per column of the attention
    /// layers' keys and per sequence of linear-attention states, is what its cache holds.
    #[test]
    fn admission_counts_what_the_cache_holds() {
        for arch in [Arch::Qwen3_5, Arch::Qwen3] {
            let config = preset_config(arch, Preset::Tiny, 300, 1, 2);
            let model = random_model(&config, DType::F32);
            let tokenizer = crate::init::build_tokenizer().unwrap();
            let stopping = Stopping {
                eos: &[],
                tokenizer: &tokenizer,
            };
            let mut engine = Engine::new(&model, stopping, None, Limits::default());
            let params = GenerationParams {
                max_tokens: 8,
                ..Default::default()
            };
            let prompts = [vec![5u32, 9, 14], vec![7, 100, 200, 3, 4]];
            engine.submit(
                prompts
                    .iter()
                    .map(|p| (p.clone(), params.clone()))
                    .collect(),
                Box::new(Quiet),
            );
            while engine.running.len() < prompts.len() {
                assert!(engine.step().is_empty(), "{arch}: ended before running");
            }
            engine.step();
            let (rows, columns) = (engine.running.len(), engine.cache.capacity());
            let projected =
                rows * (Engine::kv_bytes_per_row(&model, columns) + engine.state_bytes_per_row());
            assert_eq!(projected, engine.kv_bytes(), "{arch}");
            assert_eq!(
                engine.state_bytes_per_row() > 0,
                arch == Arch::Qwen3_5,
                "{arch}: states per sequence"
            );
        }
    }

    /// The log-probabilities `[positions][vocab]` of the whole sequence, by the forward pass without a
    /// cache (what the cached steps must match).
    fn full_forward(model: &Model, sequence: &[u32]) -> Vec<Vec<f32>> {
        let device = model.device();
        let input = Tensor::new(sequence, device).unwrap().unsqueeze(0).unwrap();
        let mask = Tensor::ones((1, sequence.len()), DType::U8, device).unwrap();
        let positions = crate::model::positions_from_mask(&mask).unwrap();
        let hidden = model
            .forward_hidden(&input, &positions, &mask, None, Ops::Fast)
            .unwrap()
            .squeeze(0)
            .unwrap();
        let logits = model.logits(&hidden, Ops::Fast).unwrap();
        candle_nn::ops::log_softmax(&logits, 1)
            .unwrap()
            .to_vec2()
            .unwrap()
    }

    /// Each sampled token is the full forward's greedy choice after the prompt and the tokens before
    /// it, with its log-probability.
    fn check_against_full_forward(
        model: &Model,
        prompt: &[u32],
        generation: &Generation,
        what: &str,
    ) {
        let sequence = [prompt, &generation.tokens].concat();
        let full = full_forward(model, &sequence);
        for (i, (&token, &logprob)) in generation
            .tokens
            .iter()
            .zip(&generation.logprobs)
            .enumerate()
        {
            let row = &full[prompt.len() - 1 + i];
            let greedy = (0..row.len())
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap();
            assert_eq!(token as usize, greedy, "{what}: token {i}");
            let difference = (row[token as usize] - logprob).abs();
            assert!(
                difference < 1e-4,
                "{what}: token {i}: |Δ logprob| {difference}"
            );
        }
    }

    /// Past their window, the windowed layers of Gemma 3, Mistral and gpt-oss models hold a bounded
    /// number of columns while the global layers hold every one, and the tokens and log-probabilities
    /// are the full forward's: for rows of different lengths decoding together, for a row paused and
    /// resumed from its trimmed keys, and for next turns read from the prefix cache (one extending a
    /// trimmed sequence, which it reuses, and one sharing only its start, which it must not).
    #[test]
    fn windowed_layers_keep_only_what_they_read() {
        for arch in [Arch::Gemma3, Arch::Mistral, Arch::GptOss] {
            let config = preset_config(arch, Preset::Tiny, 300, 1, 2);
            let model = random_model(&config, DType::F32);
            let windows: Vec<Option<usize>> =
                config.layers.iter().map(|layer| layer.window).collect();
            assert!(
                windows.iter().any(Option::is_some),
                "{arch}: a windowed layer"
            );
            let tokenizer = crate::init::build_tokenizer().unwrap();
            let stopping = Stopping {
                eos: &[],
                tokenizer: &tokenizer,
            };
            let prefix = PrefixCache::new(100_000);
            // Two places: a second submission pauses one of the first's rows.
            let limits = Limits {
                max_num_seqs: 2,
                ..Limits::default()
            };
            let mut engine = Engine::new(&model, stopping, Some(&prefix), limits);
            let greedy = |max_tokens| GenerationParams {
                max_tokens,
                temperature: 0.0,
                ..Default::default()
            };
            let first: Vec<Vec<u32>> = vec![(3..8).collect(), (10..31).collect()];
            let second: Vec<u32> = (40..53).collect();
            let mut results = HashMap::new();
            let first_id = engine.submit(
                first.iter().map(|p| (p.clone(), greedy(50))).collect(),
                Box::new(Quiet),
            );
            let mut steps = 0;
            let mut paused = false;
            while results.len() < 2 {
                if steps == 30 {
                    engine.submit(vec![(second.clone(), greedy(40))], Box::new(Quiet));
                }
                results.extend(engine.step());
                paused |= engine.groups.values().any(|group| {
                    group
                        .waiting
                        .iter()
                        .any(|w| matches!(w, Waiting::Paused { .. }))
                });
                let (columns, held) = (engine.cache.len(), engine.cache.held());
                for (l, window) in windows.iter().enumerate() {
                    if engine.running.is_empty() {
                        continue;
                    }
                    match window {
                        Some(window) => assert!(
                            held[l] < window + trim_block(*window),
                            "{arch} step {steps}: layer {l} holds {} of {columns} columns",
                            held[l]
                        ),
                        None => assert_eq!(held[l], columns, "{arch}: global layer {l}"),
                    }
                }
                steps += 1;
                assert!(steps < 500, "{arch}: the rows end");
            }
            assert!(paused, "{arch}: a row was paused");
            assert!(
                engine.cache.len() > 60 || steps > 60,
                "{arch}: rows past the window"
            );
            let generations = |id: u64, results: &HashMap<u64, Results>| -> Vec<Generation> {
                results[&id].iter().map(|r| r.clone().unwrap()).collect()
            };
            let firsts = generations(first_id, &results);
            for (i, (prompt, generation)) in first.iter().zip(&firsts).enumerate() {
                assert_eq!(generation.tokens.len(), 50);
                check_against_full_forward(&model, prompt, generation, &format!("{arch} row {i}"));
            }
            let second_result = results
                .iter()
                .find(|(&id, _)| id != first_id)
                .map(|(_, r)| r[0].clone().unwrap())
                .unwrap();
            check_against_full_forward(&model, &second, &second_result, &format!("{arch} second"));

            // The next turn of the long row extends its whole (trimmed) sequence: read from the cache.
            let sequence = [first[1].clone(), firsts[1].tokens.clone()].concat();
            let next_turn = [&sequence[..], &[7, 8, 9]].concat();
            // Another prompt shares only the long row's first tokens, whose keys the windowed layers
            // dropped: it runs whole.
            let elsewhere = [&first[1][..12], &[5, 6]].concat();
            for (prompt, reused) in [(next_turn, sequence.len() - 1), (elsewhere, 0)] {
                let before = prefix.reused_tokens();
                let mut engine = Engine::new(&model, stopping, Some(&prefix), Limits::default());
                let id = engine.submit(vec![(prompt.clone(), greedy(20))], Box::new(Quiet));
                let mut done = Vec::new();
                while done.is_empty() {
                    done = engine.step();
                }
                assert_eq!(done[0].0, id);
                let generation = done[0].1[0].clone().unwrap();
                assert_eq!(
                    prefix.reused_tokens() - before,
                    reused,
                    "{arch}: tokens reused"
                );
                check_against_full_forward(&model, &prompt, &generation, &format!("{arch} turn"));
            }
        }
    }
}
