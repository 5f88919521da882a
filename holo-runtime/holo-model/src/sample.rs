//! One row's sampling: its parameters, seed, stop strings and length; its next token drawn from its
//! logits, with the token's log-probability under the policy (temperature 1) and under the distribution
//! it was drawn from; when it ends; and the prefix cache that keeps finished sequences for the next turn.
//!
//! How rows are batched (prefill, joining and leaving the batch) is the [scheduler](super::schedule)'s
//! business, and [`generate`](super::generate) runs prompts through it; on a GPU most rows are drawn
//! where their logits are, by `draw.rs`, and only recorded here.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokenizers::Tokenizer;

use super::constrain::{Constrained, Grammar};
use super::model::{starts, Result, SequenceCache};
use holo_core::machine::Finish;
use holo_core::stop::{first_stop, StopMatcher, StreamedText};

/// How one row is sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationParams {
    pub max_tokens: usize,
    /// 0 samples greedily.
    pub temperature: f64,
    /// Nucleus sampling: the smallest set of most likely tokens whose probability reaches `top_p`; 1 keeps
    /// all.
    pub top_p: f64,
    /// Only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Sampling ends after the first of these appears in the decoded text, which keeps it; under a
    /// constraint, only where one ends the text and the constraint accepts the text through it.
    pub stop: Vec<String>,
    pub seed: u64,
    /// How many of the most likely tokens to record at each position (see [`Generation::top_logprobs`]).
    pub top_logprobs: usize,
    /// The language the row's text must belong to ([`crate::Grammars::compile`]): its logits are masked
    /// at every step, and every log-probability recorded is the masked distribution's.
    pub constraint: Option<Grammar>,
    /// Added to these tokens' logits before each draw; the log-probabilities recorded are those of the
    /// biased distribution.
    pub logit_bias: Vec<(u32, f32)>,
    /// The end-of-turn and stop tokens are masked, and stop strings not matched, until the row has
    /// this many tokens.
    pub min_tokens: usize,
    /// More tokens that end the row (as an end-of-turn token does).
    pub stop_token_ids: Vec<u32>,
    /// End-of-turn tokens do not end the row.
    pub ignore_eos: bool,
    /// Record the experts a mixture-of-experts model routes each token through
    /// ([`Generation::routes`]), for routing replay in training.
    pub record_routes: bool,
    /// With `Some(k)`: score the prompt, every token after the first with the `k` most likely tokens at
    /// its position (see [`holo_core::TokenSink::prompt_logprobs`]). The prompt then runs whole, the
    /// prefix cache unread (as vLLM does), and `max_tokens` may be 0.
    pub prompt_logprobs: Option<usize>,
}

impl Default for GenerationParams {
    fn default() -> Self {
        GenerationParams {
            max_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            stop: Vec::new(),
            seed: 0,
            top_logprobs: 0,
            constraint: None,
            logit_bias: Vec::new(),
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            record_routes: false,
            prompt_logprobs: None,
        }
    }
}

/// What one row produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Sampled token ids, the end-of-turn token included when one ended the row.
    pub tokens: Vec<u32>,
    /// `log p(token)` under the policy at temperature 1, one per token.
    pub logprobs: Vec<f32>,
    /// `log q(token)` under the distribution the token was drawn from (temperature, top-k, top-p
    /// applied); 0 for greedy choices.
    pub sampling_logprobs: Vec<f32>,
    /// With [`GenerationParams::top_logprobs`] = k > 0, per token the k most likely tokens of the policy
    /// at temperature 1 (the distribution of `logprobs`) and their log-probabilities, most likely first.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// The decoded tokens without special tokens, ending with the stop string when one matched.
    pub text: String,
    pub finish: Finish,
    /// With [`GenerationParams::record_routes`] on a mixture-of-experts model: for each token the model
    /// read (the prompt's, then every sampled token but the last), the experts each mixture layer
    /// routed it to (see [`crate::model::Routes::per_token`]); empty for a token it did not compute
    /// here (a prompt prefix the prefix cache held). Empty otherwise.
    pub routes: Vec<Vec<u32>>,
}

/// Token ids that end a row, and the tokenizer that decodes rows for stop strings.
#[derive(Clone, Copy)]
pub struct Stopping<'a> {
    pub eos: &'a [u32],
    pub tokenizer: &'a Tokenizer,
}

/// A sequence being sampled.
pub(super) struct Row {
    /// Its place in the submission it belongs to.
    pub(super) index: usize,
    pub(super) params: GenerationParams,
    rng: ChaCha8Rng,
    /// The tokens run through the model so far (prompt, then sampled tokens once fed).
    pub(super) fed: Vec<u32>,
    /// With [`GenerationParams::record_routes`]: the experts of each token of `fed` once the prompt is
    /// prefilled (see [`Generation::routes`]).
    pub(super) routes: Vec<Vec<u32>>,
    /// Which columns of the batch's cache (then of the tokens being fed) are this row's.
    pub(super) key_mask: Vec<u8>,
    pub(super) generation: Generation,
    /// The row's text, decoded a token at a time, for stop strings.
    stops: StopSearch,
    /// The row's parser, when it samples under a constraint.
    constrained: Option<Constrained>,
    pub(super) done: bool,
}

impl Row {
    pub(super) fn new(index: usize, prompt: Vec<u32>, params: GenerationParams) -> Row {
        Row {
            index,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            done: params.max_tokens == 0,
            constrained: params.constraint.as_ref().map(Grammar::start),
            fed: prompt,
            routes: Vec::new(),
            key_mask: Vec::new(),
            generation: Generation {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                sampling_logprobs: Vec::new(),
                top_logprobs: Vec::new(),
                text: String::new(),
                finish: Finish::Length,
                routes: Vec::new(),
            },
            stops: StopSearch::default(),
            params,
        }
    }

    /// Whether [`super::draw`] can sample this row on the model's device: the whole vocabulary at some
    /// temperature (or greedily), without the most likely alternatives, a constraint, a logit bias or
    /// tokens masked for `min_tokens`, which need the row's logits.
    pub(super) fn draws_on_device(&self, vocab: usize) -> bool {
        !restricted(&self.params, vocab)
            && self.params.top_logprobs == 0
            && self.constrained.is_none()
            && self.params.logit_bias.is_empty()
            && self.generation.tokens.len() >= self.params.min_tokens
    }

    /// The next uniform draw of the row's generator in `[0, 1)`, as [`choose`] takes it for a
    /// sampled (not greedy) token: the device draw consumes the generator exactly as the host's does.
    pub(super) fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// The sampled token the model has not run yet.
    pub(super) fn unfed(&self) -> u32 {
        *self
            .generation
            .tokens
            .last()
            .expect("a live row has sampled")
    }
}

/// Keys and values of sequences the model has already run, reused when a later prompt extends one: the
/// next turn of a multi-turn rollout (its earlier prompt and completion, then new text) only runs its new
/// tokens. Least recently used sequences are dropped beyond `capacity` tokens. The cached values belong
/// to the weights that made them: [`PrefixCache::clear`] after changing the weights.
pub struct PrefixCache {
    capacity: usize,
    entries: Mutex<VecDeque<CachedSequence>>,
    reused: AtomicUsize,
}

struct CachedSequence {
    tokens: Vec<u32>,
    layers: SequenceCache,
}

impl PrefixCache {
    /// A cache of at most `capacity` tokens over all sequences (0 keeps nothing).
    pub fn new(capacity: usize) -> Self {
        PrefixCache {
            capacity,
            entries: Mutex::new(VecDeque::new()),
            reused: AtomicUsize::new(0),
        }
    }

    pub fn clear(&self) {
        self.lock().clear();
    }

    /// Tokens held, over all sequences.
    pub fn tokens(&self) -> usize {
        self.lock().iter().map(|entry| entry.tokens.len()).sum()
    }

    /// Prompt tokens that did not run again because the cache held them, since the cache was made.
    pub fn reused_tokens(&self) -> usize {
        self.reused.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<CachedSequence>> {
        // A panic elsewhere while holding the lock leaves whole entries: still consistent.
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The longest cached run of tokens that starts `prompt`, leaving at least its last token to run (its
    /// logits pick the first sampled token): the length and each layer's keys and values. With
    /// LongRoPE's `long_rope_context` ([`crate::model::Model::long_rope_context`]), only from a sequence
    /// on the same side of it as `prompt`: a sequence's keys were rotated by the factors of its whole
    /// length.
    pub(super) fn lookup(
        &self,
        prompt: &[u32],
        long_rope_context: Option<usize>,
    ) -> Result<Option<(usize, SequenceCache)>> {
        let long = |length: usize| long_rope_context.map(|context| length > context);
        let mut entries = self.lock();
        let best = entries
            .iter()
            .enumerate()
            .map(|(i, entry)| {
                let common = entry
                    .tokens
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count()
                    .min(prompt.len().saturating_sub(1));
                // A state holds its whole sequence: such an entry starts only a prompt that extends it.
                // A windowed layer that dropped the sequence's first positions starts only a prompt
                // whose window does not reach back to them.
                let usable = starts(&entry.layers, common, entry.tokens.len())
                    && long(entry.tokens.len()) == long(prompt.len());
                (i, if usable { common } else { 0 })
            })
            .max_by_key(|&(_, length)| length);
        let Some((i, length)) = best.filter(|&(_, length)| length > 0) else {
            return Ok(None);
        };
        let entry = entries.remove(i).expect("an index from the scan");
        let whole = entry.tokens.len();
        let layers = entry
            .layers
            .iter()
            .map(|layer| {
                layer.prefix(length, whole)?.ok_or_else(|| {
                    candle_core::Error::Msg("a cached layer cannot start this prompt".into())
                })
            })
            .collect::<Result<Vec<_>>>()?;
        entries.push_front(entry);
        self.reused.fetch_add(length, Ordering::Relaxed);
        Ok(Some((length, layers)))
    }

    pub(super) fn insert(&self, tokens: Vec<u32>, layers: SequenceCache) {
        if tokens.is_empty() || tokens.len() > self.capacity {
            return;
        }
        let mut entries = self.lock();
        // A sequence that another one extends is redundant.
        entries.retain(|entry| !tokens.starts_with(&entry.tokens));
        if entries
            .iter()
            .any(|entry| entry.tokens.starts_with(&tokens))
        {
            return;
        }
        entries.push_front(CachedSequence { tokens, layers });
        let mut held: usize = entries.iter().map(|entry| entry.tokens.len()).sum();
        while held > self.capacity {
            let dropped = entries.pop_back().expect("held > 0");
            held -= dropped.tokens.len();
        }
    }
}

/// Samples one token for `row` from its last-position logits (masked by its constraint, when it has
/// one) and decides whether the row is done; returns the token and its logprob under the policy (the
/// masked policy for a constrained row).
pub(super) fn step(row: &mut Row, logits: &[f32], stopping: &Stopping) -> Result<(u32, f32)> {
    let shaped = shaped(row, logits, stopping);
    let logits = shaped.as_deref().unwrap_or(logits);
    let (drawn, top) = match row.constrained.as_mut() {
        None => host_draw(logits, &row.params, &mut row.rng),
        Some(constrained) => {
            let masked = constrained.mask(logits)?;
            let (drawn, top) = host_draw(&masked, &row.params, &mut row.rng);
            constrained.advance(drawn.token)?;
            (drawn, top)
        }
    };
    record(row, drawn, top, stopping)
}

/// The row's logits with its `logit_bias` added and, before `min_tokens`, its ending tokens masked;
/// `None` when neither applies.
fn shaped(row: &Row, logits: &[f32], stopping: &Stopping) -> Option<Vec<f32>> {
    let params = &row.params;
    let early = row.generation.tokens.len() < params.min_tokens;
    if params.logit_bias.is_empty() && !early {
        return None;
    }
    let mut logits = logits.to_vec();
    for &(token, bias) in &params.logit_bias {
        if let Some(logit) = logits.get_mut(token as usize) {
            *logit += bias;
        }
    }
    if early {
        for &token in stopping.eos.iter().chain(&params.stop_token_ids) {
            if let Some(logit) = logits.get_mut(token as usize) {
                *logit = f32::NEG_INFINITY;
            }
        }
    }
    Some(logits)
}

/// Draws a token from a row's logits with its generator, and the most likely tokens when the row
/// records them.
pub(super) fn host_draw(
    logits: &[f32],
    params: &GenerationParams,
    rng: &mut ChaCha8Rng,
) -> (Drawn, Option<Vec<(u32, f32)>>) {
    let (token, sampling_logprob) = choose(logits, params, rng);
    let normaliser = (params.top_logprobs > 0).then(|| log_sum_exp(logits));
    // At temperature 1 over the whole vocabulary the token was drawn from the policy itself.
    let logprob = if params.temperature == 1.0 && !restricted(params, logits.len()) {
        sampling_logprob
    } else {
        logits[token as usize] - normaliser.unwrap_or_else(|| log_sum_exp(logits))
    };
    let drawn = Drawn {
        token,
        logprob,
        sampling_logprob,
    };
    let top = normaliser.map(|normaliser| most_likely(logits, params.top_logprobs, normaliser));
    (drawn, top)
}

/// A sampled token with its log-probabilities: under the policy at temperature 1, and under the
/// distribution it was drawn from (0 for a greedy choice).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Drawn {
    pub(super) token: u32,
    pub(super) logprob: f32,
    pub(super) sampling_logprob: f32,
}

/// Appends a drawn token (and its most likely alternatives, when the row records them) to the row's
/// generation and decides whether the row is done; returns the token and its logprob under the policy.
pub(super) fn record(
    row: &mut Row,
    drawn: Drawn,
    top: Option<Vec<(u32, f32)>>,
    stopping: &Stopping,
) -> Result<(u32, f32)> {
    let Drawn {
        token,
        logprob,
        sampling_logprob,
    } = drawn;
    let generation = &mut row.generation;
    if let Some(top) = top {
        generation.top_logprobs.push(top);
    }
    generation.tokens.push(token);
    generation.logprobs.push(logprob);
    generation.sampling_logprobs.push(sampling_logprob);
    let params = &row.params;
    let ends_turn = (!params.ignore_eos && stopping.eos.contains(&token))
        || params.stop_token_ids.contains(&token);
    if ends_turn {
        generation.finish = Finish::EndOfTurn;
        row.done = true;
    } else if !params.stop.is_empty()
        && row.stops.may_stop(token, &params.stop, stopping)
        && generation.tokens.len() >= params.min_tokens
    {
        // The stop is cut where the whole completion's decoding has it, as the text is reported; one
        // that ends within the first `min_tokens` tokens does not count.
        let text = decode(stopping.tokenizer, &generation.tokens)?;
        let searched = match params.min_tokens {
            0 => 0,
            min => decode(stopping.tokenizer, &generation.tokens[..min])?.len(),
        };
        let found = match row.constrained.as_mut() {
            None => first_stop(&text, searched, &params.stop),
            // Under a constraint the grammar decides where the text ends: a stop string ends the row
            // only where it ends the text and the grammar accepts the text through it, so a fence's
            // closing tag inside a JSON string the grammar is still in is text, not the end.
            Some(constrained) => match ending_stop(&text, searched, &params.stop) {
                Some(found) if constrained.accepts()? => Some(found),
                _ => None,
            },
        };
        if let Some((at, stop)) = found {
            generation.text = text[..at + stop.len()].to_string();
            generation.finish = Finish::Stop(stop.clone());
            row.done = true;
        }
    }
    if !row.done && generation.tokens.len() >= params.max_tokens {
        generation.finish = Finish::Length;
        row.done = true;
    }
    Ok((token, logprob))
}

/// The stop string that `text` ends with, past its first `searched` bytes, and where it starts.
fn ending_stop<'s>(
    text: &str,
    searched: usize,
    stops: &'s [String],
) -> Option<(usize, &'s String)> {
    stops
        .iter()
        .filter(|stop| !stop.is_empty() && text.ends_with(stop.as_str()))
        .map(|stop| (text.len() - stop.len(), stop))
        .find(|(at, stop)| at + stop.len() > searched)
}

/// The `k` largest logits as `(token, logit - normaliser)`, largest first (the lower id among equals),
/// leaving out tokens a constraint masked (`-inf`), which the row could not draw.
pub(super) fn most_likely(logits: &[f32], k: usize, normaliser: f32) -> Vec<(u32, f32)> {
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(ids.len());
    if k == 0 {
        return Vec::new();
    }
    ids.select_nth_unstable_by(k - 1, by_logit);
    ids.truncate(k);
    ids.sort_unstable_by(by_logit);
    ids.into_iter()
        .filter(|&id| logits[id as usize] != f32::NEG_INFINITY)
        .map(|id| (id, logits[id as usize] - normaliser))
        .collect()
}

/// A row's text decoded a token at a time, and its stop strings matched as it grows ([`StopMatcher`]),
/// instead of decoding and searching the whole completion at each step.
#[derive(Default)]
struct StopSearch {
    decoded: StreamedText,
    /// Built at the first token, from the row's stop strings.
    matcher: Option<StopMatcher>,
    /// The stream decoder or the automaton could not go on: every step decodes and searches the whole
    /// completion.
    whole: bool,
}

impl StopSearch {
    /// Adds `token`; whether a stop string may now end the text (then the caller finds it in the whole
    /// decoding).
    fn may_stop(&mut self, token: u32, stops: &[String], stopping: &Stopping) -> bool {
        if self.whole {
            return true;
        }
        if self.matcher.is_none() {
            match StopMatcher::new(stops) {
                Some(matcher) => self.matcher = Some(matcher),
                None if stops.iter().all(String::is_empty) => return false,
                None => {
                    self.whole = true;
                    return true;
                }
            }
        }
        let piece = match self.decoded.push(stopping.tokenizer, token) {
            Ok(Some(piece)) => piece,
            Ok(None) => return false,
            Err(_) => {
                self.whole = true;
                return true;
            }
        };
        self.matcher
            .as_mut()
            .is_some_and(|matcher| matcher.feed(piece))
    }
}

pub(super) fn finish_text(row: &mut Row, stopping: &Stopping) -> Result<()> {
    if !matches!(row.generation.finish, Finish::Stop(_)) {
        row.generation.text = decode(stopping.tokenizer, &row.generation.tokens)?;
    }
    Ok(())
}

fn decode(tokenizer: &Tokenizer, tokens: &[u32]) -> Result<String> {
    tokenizer
        .decode(tokens, true)
        .map_err(|error| candle_core::Error::Msg(format!("cannot decode sampled tokens: {error}")))
}

/// `log Σ exp(x)`, the normaliser of the policy's log-probabilities at temperature 1.
pub(super) fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    sum.ln() as f32 + max
}

/// Picks a token: greedy at temperature 0, otherwise temperature, then top-k, then top-p (vLLM's
/// order), drawn with the row's RNG. Returns the token and its log-probability under that distribution.
fn choose(logits: &[f32], params: &GenerationParams, rng: &mut ChaCha8Rng) -> (u32, f32) {
    if params.temperature <= 0.0 {
        let (token, _) = logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
                if x > best.1 {
                    (i, x)
                } else {
                    best
                }
            });
        return (token as u32, 0.0);
    }
    let temperature = params.temperature as f32;
    if !restricted(params, logits.len()) {
        return draw_unrestricted(logits, temperature, rng);
    }
    let scaled: Vec<f32> = logits.iter().map(|&x| x / temperature).collect();
    let mut candidates: Vec<u32> = (0..scaled.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| scaled[*b as usize].total_cmp(&scaled[*a as usize]);
    if params.top_k > 0 && params.top_k < candidates.len() {
        candidates.select_nth_unstable_by(params.top_k - 1, by_logit);
        candidates.truncate(params.top_k);
    }
    candidates.sort_unstable_by(by_logit);
    let max = candidates
        .iter()
        .map(|&i| scaled[i as usize])
        .fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = candidates
        .iter()
        .map(|&i| ((scaled[i as usize] - max) as f64).exp())
        .collect();
    let mut total: f64 = weights.iter().sum();
    let mut kept = candidates.len();
    if params.top_p < 1.0 {
        let mut cumulative = 0.0;
        for (i, weight) in weights.iter().enumerate() {
            cumulative += weight / total;
            if cumulative >= params.top_p {
                kept = i + 1;
                break;
            }
        }
        total = weights[..kept].iter().sum();
    }
    let mut threshold = rng.random::<f64>() * total;
    let mut chosen = kept - 1;
    for (i, weight) in weights[..kept].iter().enumerate() {
        if threshold < *weight {
            chosen = i;
            break;
        }
        threshold -= weight;
    }
    let logprob = (weights[chosen] / total).ln() as f32;
    (candidates[chosen], logprob)
}

/// Whether top-k or top-p leave out part of a vocabulary of `size` tokens.
fn restricted(params: &GenerationParams, size: usize) -> bool {
    (params.top_k > 0 && params.top_k < size) || params.top_p < 1.0
}

/// [`choose`] over the whole vocabulary, without materialising the distribution: the same draws, in
/// one pass for the normaliser and part of a second for the token.
fn draw_unrestricted(logits: &[f32], temperature: f32, rng: &mut ChaCha8Rng) -> (u32, f32) {
    thread_local! {
        /// The weights of the last draw on this thread, kept for their allocation.
        static WEIGHTS: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let max = logits
        .iter()
        .map(|&x| x / temperature)
        .fold(f32::NEG_INFINITY, f32::max);
    // Each weight is computed once (an f64 exponential per vocabulary entry, 151,936 of them for Qwen
    // models), for the total and the scan alike.
    WEIGHTS.with_borrow_mut(|weights| {
        weights.clear();
        weights.extend(
            logits
                .iter()
                .map(|&x| ((x / temperature - max) as f64).exp()),
        );
        let total: f64 = weights.iter().sum();
        let mut threshold = rng.random::<f64>() * total;
        let mut chosen = logits.len() - 1;
        for (i, &weight) in weights.iter().enumerate() {
            if threshold < weight {
                chosen = i;
                break;
            }
            threshold -= weight;
        }
        let logprob = (weights[chosen] / total).ln() as f32;
        (chosen as u32, logprob)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_softmax(logits: &[f32]) -> Vec<f32> {
        let log_sum = log_sum_exp(logits);
        logits.iter().map(|&x| x - log_sum).collect()
    }

    fn params(temperature: f64, top_k: usize, top_p: f64) -> GenerationParams {
        GenerationParams {
            temperature,
            top_k,
            top_p,
            ..Default::default()
        }
    }

    #[test]
    fn greedy_takes_the_largest_logit() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(
            choose(&[0.1, 3.0, -1.0, 2.9], &params(0.0, 0, 1.0), &mut rng),
            (1, 0.0)
        );
    }

    #[test]
    fn top_k_one_is_greedy_with_probability_one() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for _ in 0..20 {
            let (token, logprob) = choose(&[0.1, 3.0, -1.0, 2.9], &params(1.0, 1, 1.0), &mut rng);
            assert_eq!(token, 1);
            assert!(logprob.abs() < 1e-6);
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus_and_renormalises() {
        // probabilities 0.5, 0.3, 0.2 (as logits of their logs): top_p 0.7 keeps the first two.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut seen = [0usize; 3];
        for _ in 0..2000 {
            let (token, logprob) = choose(&logits, &params(1.0, 0, 0.7), &mut rng);
            seen[token as usize] += 1;
            let expected = if token == 0 { 0.5 / 0.8 } else { 0.3 / 0.8 };
            assert!(
                (logprob - (expected as f32).ln()).abs() < 1e-5,
                "{token} {logprob}"
            );
        }
        assert_eq!(seen[2], 0);
        assert!((1100..1400).contains(&seen[0]), "{seen:?}");
    }

    #[test]
    fn sampling_follows_the_tempered_distribution() {
        let logits = [0.0f32, 1.0, 2.0];
        let temperature = 2.0;
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut seen = [0usize; 3];
        let draws = 6000;
        for _ in 0..draws {
            let (token, logprob) = choose(&logits, &params(temperature, 0, 1.0), &mut rng);
            seen[token as usize] += 1;
            let tempered: Vec<f32> = logits.iter().map(|x| x / temperature as f32).collect();
            assert!((logprob - log_softmax(&tempered)[token as usize]).abs() < 1e-5);
        }
        let tempered: Vec<f32> = logits.iter().map(|x| x / temperature as f32).collect();
        for (token, count) in seen.iter().enumerate() {
            let expected = log_softmax(&tempered)[token].exp() * draws as f32;
            assert!(
                (*count as f32 - expected).abs() < 0.08 * draws as f32,
                "{seen:?}"
            );
        }
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..30)
                .map(|_| choose(&logits, &params(1.0, 0, 1.0), &mut rng).0)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
    }
}
