//! Answer choices and their logprobs: token names, text offsets, the bytes of each token.

use super::*;

/// A completion as an OpenAI choice.
pub(super) struct Choice<'a> {
    pub(super) completion: &'a Completion,
    pub(super) text: String,
    pub(super) finish_reason: &'static str,
    pub(super) stop_reason: Value,
    pub(super) token_count: usize,
    /// The calls read from the reply when the request's tools are read ([`Common::tool_format`]);
    /// `text` is then the reply's content before them.
    pub(super) tool_calls: Vec<holo_core::tools::ToolCall>,
    /// With a reasoning parser ([`Common::reading`]): the reply's reasoning, split out of `text`,
    /// which is then its content (from which tool calls are read).
    pub(super) reasoning: Option<String>,
    /// Whether the reply has content (not when a reasoning parser found none: the reply was cut
    /// inside its reasoning, or ended with it).
    pub(super) has_content: bool,
    /// With a reasoning parser, how many of its tokens are reasoning (see [`reasoning_tokens`]).
    pub(super) reasoning_tokens: Option<usize>,
}

impl<'a> Choice<'a> {
    pub(super) fn new(
        state: &AppState,
        completion: &'a Completion,
        common: &Common,
    ) -> Result<Self, ApiError> {
        if !completion.tokens.is_empty()
            && !completion.logprobs.is_empty()
            && completion.tokens.len() != completion.logprobs.len()
        {
            return Err(ApiError::from_sampler(SamplerError::Malformed(format!(
                "{} token ids but {} logprobs",
                completion.tokens.len(),
                completion.logprobs.len()
            ))));
        }
        let mut text = completion.text.clone();
        let (finish_reason, stop_reason) = match &completion.finish {
            Finish::Length => ("length", Value::Null),
            Finish::EndOfTurn => ("stop", Value::Null),
            Finish::Stop(stop) if stop.is_empty() => ("stop", Value::Null),
            Finish::Stop(stop) => {
                if !common.include_stop && text.ends_with(stop.as_str()) {
                    text.truncate(text.len() - stop.len());
                }
                ("stop", Value::String(stop.clone()))
            }
        };
        let mut finish_reason = finish_reason;
        let mut reasoning = None;
        let mut has_content = true;
        let mut tool_calls = Vec::new();
        match (common.harmony, common.reading) {
            (Some(harmony), _) => {
                // A sampler that reports no tokens leaves only its text, which has no markers: all of
                // it is content.
                if !completion.tokens.is_empty() {
                    let (reply, _) = state.vocab.decoding(&completion.tokens, true);
                    let (thought, content) = harmony.parts(&reply, false);
                    reasoning = thought;
                    has_content = content.is_some();
                    text = content.unwrap_or_default();
                    let calls = common
                        .tool_format
                        .filter(|&format| format == ToolFormat::Harmony)
                        .and_then(|format| format.parse(&reply));
                    if let Some(reply) = calls {
                        tool_calls = reply.calls;
                        finish_reason = "tool_calls";
                    }
                }
            }
            (None, reading) => {
                if let Some(reading) = reading {
                    let (thought, content) = reading.parts(&text).of(&text);
                    reasoning = thought;
                    has_content = content.is_some();
                    text = content.unwrap_or_default();
                }
                if let Some(reply) = common
                    .tool_format
                    .and_then(|format| read_reply(state, format, reading, completion, &text))
                {
                    text = reply.content.unwrap_or_default();
                    tool_calls = reply.calls;
                    finish_reason = "tool_calls";
                }
            }
        }
        let token_count = if completion.tokens.is_empty() {
            state
                .tokenizer
                .encode(completion.text.as_str(), false)
                .map(|encoding| encoding.len())
                .unwrap_or(0)
        } else {
            completion.tokens.len()
        };
        Ok(Choice {
            completion,
            text,
            finish_reason,
            stop_reason,
            token_count,
            tool_calls,
            reasoning,
            has_content,
            reasoning_tokens: state
                .reasoning_parser
                .map(|_| reasoning_tokens(state, common, &completion.tokens)),
        })
    }

    /// Whether the sampler reported what a logprobs block needs.
    pub(super) fn has_logprobs(&self) -> bool {
        !self.completion.tokens.is_empty() && !self.completion.logprobs.is_empty()
    }

    pub(super) fn completion_logprobs(&self, state: &AppState, common: &Common) -> Value {
        if !self.has_logprobs() {
            return Value::Null;
        }
        let completion = self.completion;
        completion_logprobs(
            state,
            common,
            &completion.tokens,
            &completion.logprobs,
            &completion.top_logprobs,
            (0, 0),
        )
    }

    /// The `logprobs` block of a choice that echoes its prompt (see [`echo_logprobs`]).
    pub(super) fn echo_logprobs(
        &self,
        state: &AppState,
        common: &Common,
        prompt: &[u32],
        scored: &PromptLogprobs,
    ) -> Value {
        let completion = self.completion;
        echo_logprobs(
            state,
            common,
            (prompt, scored),
            &completion.tokens,
            &completion.logprobs,
            &completion.top_logprobs,
        )
    }

    pub(super) fn chat_logprobs(&self, state: &AppState, common: &Common) -> Value {
        if !self.has_logprobs() {
            return Value::Null;
        }
        chat_logprobs(
            state,
            common,
            &self.completion.tokens,
            &self.completion.logprobs,
            &self.completion.top_logprobs,
        )
    }
}

/// How many of a reply's tokens (`tokens`, so far) are reasoning, as the request's reading counts
/// them (see [`Reading::reasoning_tokens`], [`Harmony::reasoning_tokens`]): 0 when its replies are not
/// split (a constrained reply) or the sampler reported no tokens.
pub(super) fn reasoning_tokens(state: &AppState, common: &Common, tokens: &[u32]) -> usize {
    match (common.harmony, common.reading) {
        (Some(_), _) => {
            let (reply, ends) = state.vocab.decoding(tokens, true);
            Harmony::reasoning_tokens(&reply, &ends)
        }
        (None, Some(reading)) => {
            let (text, ends) = state.vocab.decoding(tokens, false);
            reading.reasoning_tokens(&text, &ends)
        }
        (None, None) => 0,
    }
}

pub(super) fn token_name(state: &AppState, common: &Common, id: u32) -> String {
    if common.token_ids_as_tokens {
        format!("token_id:{id}")
    } else {
        String::from_utf8_lossy(&state.vocab.bytes(id)).into_owned()
    }
}

/// The entries of a position's `top_logprobs`, in vLLM's order: the sampled token first, then the most
/// likely others (`top`, most likely first).
fn alternatives(sampled: (u32, f32), top: &[(u32, f32)]) -> impl Iterator<Item = (u32, f32)> + '_ {
    std::iter::once(sampled).chain(top.iter().copied().filter(move |(id, _)| *id != sampled.0))
}

/// The `logprobs` block of a choice that echoes its prompt: the prompt's tokens (`prompt`, with the
/// log-probabilities the sampler scored it with), then the completion's (`tokens`, `logprobs`, and `top`
/// as in [`completion_logprobs`]; none for a streamed choice's first chunk). The prompt's first token
/// has no log-probability: `null` in `token_logprobs` and `top_logprobs`, as vLLM and OpenAI write it;
/// `text_offset`s count from the start of the prompt.
pub(super) fn echo_logprobs(
    state: &AppState,
    common: &Common,
    (prompt, scored): (&[u32], &PromptLogprobs),
    tokens: &[u32],
    logprobs: &[f32],
    top: &[Vec<(u32, f32)>],
) -> Value {
    let all: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
    let pieces: Vec<Vec<u8>> = all.iter().map(|&id| state.vocab.bytes(id)).collect();
    let names: Vec<String> = all
        .iter()
        .map(|&id| token_name(state, common, id))
        .collect();
    let scores: Vec<f32> = scored.logprobs.iter().chain(logprobs).copied().collect();
    let token_logprobs: Vec<Value> = std::iter::once(Value::Null)
        .chain(scores.iter().map(|&lp| logprob(lp)))
        .collect();
    // The completion's alternatives: as in a choice that does not echo (null when the sampler
    // reported none it was asked for).
    let reported = top.len() == tokens.len();
    let top_logprobs = if common.params.top_logprobs == 0 || reported {
        // The prompt may have been scored with more alternatives, for `prompt_logprobs`.
        let k = common.params.top_logprobs as usize;
        let prompt_top = scored
            .top
            .iter()
            .map(|top| top[..top.len().min(k)].to_vec());
        let alternatives = prompt_top.chain(top.iter().cloned());
        let positions = all[1..]
            .iter()
            .zip(&scores)
            .zip(alternatives.chain(std::iter::repeat(Vec::new())))
            .map(|((&id, &lp), top)| top_entries(state, common, (id, lp), &top));
        Value::Array(std::iter::once(Value::Null).chain(positions).collect())
    } else {
        Value::Null
    };
    json!({
        "tokens": names,
        "token_logprobs": token_logprobs,
        "text_offset": text_offsets(&pieces),
        "top_logprobs": top_logprobs,
    })
}

/// vLLM's `prompt_logprobs` of a prompt scored by the sampler: `null` for its first token, then per
/// token `{"id": {"logprob", "rank", "decoded_token"}}`, the prompt's token first (its rank in the
/// model's distribution), then the `k` most likely (ranks 1 to k; the prompt's token once).
pub(super) fn prompt_logprobs(
    state: &AppState,
    prompt: &[u32],
    scored: &PromptLogprobs,
    k: usize,
) -> Result<Value, ApiError> {
    let count = prompt.len().saturating_sub(1);
    if scored.logprobs.len() != count || scored.ranks.len() != count {
        return Err(ApiError::from_sampler(SamplerError::Malformed(format!(
            "the sampler scored {} positions with {} ranks for a prompt of {} tokens",
            scored.logprobs.len(),
            scored.ranks.len(),
            prompt.len()
        ))));
    }
    let entry = |id: u32, lp: f32, rank: usize| {
        json!({
            "logprob": logprob(lp),
            "rank": rank,
            "decoded_token": String::from_utf8_lossy(&state.vocab.bytes(id)),
        })
    };
    let mut positions = Vec::with_capacity(prompt.len());
    positions.push(Value::Null);
    for (i, &id) in prompt[1..].iter().enumerate() {
        let mut entries = Map::new();
        entries.insert(
            id.to_string(),
            entry(id, scored.logprobs[i], scored.ranks[i] as usize),
        );
        let top = scored.top.get(i).map_or(&[][..], Vec::as_slice);
        for (rank, &(other, lp)) in top.iter().take(k).enumerate() {
            entries
                .entry(other.to_string())
                .or_insert_with(|| entry(other, lp, rank + 1));
        }
        positions.push(Value::Object(entries));
    }
    Ok(Value::Array(positions))
}

/// A completions `logprobs` block for the tokens `tokens[from..]` of a choice whose tokens so far are
/// `tokens` (`logprobs` are theirs, and `top` their most likely alternatives, empty when the sampler
/// reported none); `text_offset` counts from the start of the choice's text, where the completion
/// starts at character `start` (after an echoed prompt; 0 otherwise).
pub(super) fn completion_logprobs(
    state: &AppState,
    common: &Common,
    tokens: &[u32],
    logprobs: &[f32],
    top: &[Vec<(u32, f32)>],
    (from, start): (usize, usize),
) -> Value {
    let pieces: Vec<Vec<u8>> = tokens.iter().map(|&id| state.vocab.bytes(id)).collect();
    let text_offset: Vec<usize> = text_offsets(&pieces)[from..]
        .iter()
        .map(|offset| offset + start)
        .collect();
    let names: Vec<String> = tokens[from..]
        .iter()
        .map(|&id| token_name(state, common, id))
        .collect();
    let token_logprobs: Vec<Value> = logprobs[from..].iter().map(|&lp| logprob(lp)).collect();
    // Per position `{token: logprob}` of the sampled token and the k most likely (up to k + 1 entries,
    // as OpenAI's and vLLM's); with k > 0, only when the sampler reported the alternatives.
    let reported = top.len() == tokens.len();
    let top_logprobs = if common.params.top_logprobs == 0 || reported {
        let positions: Vec<Value> = (from..tokens.len())
            .map(|i| {
                let top = if reported { top[i].as_slice() } else { &[] };
                top_entries(state, common, (tokens[i], logprobs[i]), top)
            })
            .collect();
        Value::Array(positions)
    } else {
        Value::Null
    };
    json!({
        "tokens": names,
        "token_logprobs": token_logprobs,
        "text_offset": text_offset,
        "top_logprobs": top_logprobs,
    })
}

/// A position's `top_logprobs` entry: `{token: logprob}` of its token and its most likely alternatives
/// (`top`), the token first.
fn top_entries(state: &AppState, common: &Common, token: (u32, f32), top: &[(u32, f32)]) -> Value {
    let mut entries = Map::new();
    for (id, lp) in alternatives(token, top) {
        entries
            .entry(token_name(state, common, id))
            .or_insert_with(|| logprob(lp));
    }
    Value::Object(entries)
}

/// A chat `logprobs` block for `tokens` (`logprobs` are theirs, and `top` their most likely alternatives,
/// empty when the sampler reported none).
pub(super) fn chat_logprobs(
    state: &AppState,
    common: &Common,
    tokens: &[u32],
    logprobs: &[f32],
    top: &[Vec<(u32, f32)>],
) -> Value {
    let entry = |id: u32, lp: f32| {
        json!({
            "token": token_name(state, common, id),
            "logprob": logprob(lp),
            "bytes": state.vocab.bytes(id),
        })
    };
    let k = common.params.top_logprobs as usize;
    let reported = top.len() == tokens.len();
    let content: Vec<Value> = tokens
        .iter()
        .zip(logprobs)
        .enumerate()
        .map(|(i, (&id, &lp))| {
            // vLLM's list: the first `top_logprobs` of the sampled token and the most likely others.
            let alternatives: Vec<Value> = match reported {
                true => alternatives((id, lp), &top[i])
                    .take(k)
                    .map(|(id, lp)| entry(id, lp))
                    .collect(),
                false => Vec::new(),
            };
            let mut value = entry(id, lp);
            value["top_logprobs"] = Value::Array(alternatives);
            value
        })
        .collect();
    json!({ "content": content })
}

/// A log-probability as JSON: `-inf` (and NaN) as vLLM's `-9999.0`.
pub(super) fn logprob(value: f32) -> Value {
    if value.is_finite() {
        json!(f64::from(value))
    } else {
        json!(-9999.0)
    }
}

/// Where each piece starts in the lossy UTF-8 decoding of all pieces together, in characters (code
/// points): the index of the character that holds the piece's first byte. A piece that starts inside a
/// character another piece began starts where that character does; a piece with no bytes starts where the
/// next one would.
pub(super) fn text_offsets(pieces: &[Vec<u8>]) -> Vec<usize> {
    let all: Vec<u8> = pieces.concat();
    // The character index of every byte, as `String::from_utf8_lossy` decodes them (one U+FFFD for each
    // invalid run), and the character count at the end.
    let mut char_of_byte = Vec::with_capacity(all.len() + 1);
    let mut index = 0;
    for chunk in all.utf8_chunks() {
        for c in chunk.valid().chars() {
            char_of_byte.extend(std::iter::repeat_n(index, c.len_utf8()));
            index += 1;
        }
        if !chunk.invalid().is_empty() {
            char_of_byte.extend(std::iter::repeat_n(index, chunk.invalid().len()));
            index += 1;
        }
    }
    char_of_byte.push(index);
    let mut start = 0;
    pieces
        .iter()
        .map(|piece| {
            let offset = char_of_byte[start];
            start += piece.len();
            offset
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------------
// Token bytes

/// How a vocabulary entry spells its bytes.
pub(super) enum Spelling {
    /// GPT-2 byte-level BPE: every byte is one printable character.
    ByteLevel(HashMap<char, u8>),
    /// SentencePiece: `▁` is a space, `<0xNN>` a raw byte.
    Metaspace,
    /// Anything else: the decoder's output for the token alone.
    Decoder,
}

pub(super) struct Vocab {
    pub(super) tokenizer: Tokenizer,
    pub(super) spelling: Spelling,
    /// Added tokens (`<|im_end|>`, ...) are stored as their text.
    pub(super) added: HashMap<u32, String>,
    /// The added tokens that are special: a decoding without special tokens skips them.
    pub(super) special: HashSet<u32>,
    /// Ids below this are in the vocabulary.
    pub(super) size: u32,
}

impl Vocab {
    pub(super) fn new(tokenizer: &Tokenizer) -> Self {
        let decoder = tokenizer
            .get_decoder()
            .and_then(|decoder| serde_json::to_string(decoder).ok())
            .unwrap_or_default();
        let spelling = if decoder.contains("\"ByteLevel\"") {
            Spelling::ByteLevel(byte_level_alphabet())
        } else if decoder.contains("ByteFallback")
            || decoder.contains("Metaspace")
            || decoder.contains('\u{2581}')
        {
            Spelling::Metaspace
        } else {
            Spelling::Decoder
        };
        let decoder = tokenizer.get_added_tokens_decoder();
        let special: HashSet<u32> = decoder
            .iter()
            .filter(|(_, token)| token.special)
            .map(|(&id, _)| id)
            .collect();
        let added: HashMap<u32, String> = decoder
            .into_iter()
            .map(|(id, token)| (id, token.content))
            .collect();
        let largest = added
            .keys()
            .copied()
            .max()
            .map_or(0, |id| id.saturating_add(1));
        let size = (tokenizer.get_vocab_size(true) as u32).max(largest);
        Vocab {
            tokenizer: tokenizer.clone(),
            spelling,
            added,
            special,
            size,
        }
    }

    /// The decoding of `tokens`, with their special tokens or without, and where each token's text
    /// ends in it (bytes): the tokens' own bytes joined, invalid UTF-8 replaced as `from_utf8_lossy`
    /// replaces it (a token that ends inside such a run ends where its replacement starts).
    pub(super) fn decoding(&self, tokens: &[u32], special: bool) -> (String, Vec<usize>) {
        let mut bytes = Vec::new();
        let mut ends = Vec::with_capacity(tokens.len());
        for &id in tokens {
            if special || !self.special.contains(&id) {
                bytes.extend(self.bytes(id));
            }
            ends.push(bytes.len());
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        if text.len() != bytes.len() {
            // Where each byte of `bytes` lands in `text`, and its end.
            let mut landing = Vec::with_capacity(bytes.len() + 1);
            let mut at = 0;
            for chunk in bytes.utf8_chunks() {
                landing.extend(at..at + chunk.valid().len());
                at += chunk.valid().len();
                if !chunk.invalid().is_empty() {
                    landing.extend(std::iter::repeat_n(at, chunk.invalid().len()));
                    at += char::REPLACEMENT_CHARACTER.len_utf8();
                }
            }
            landing.push(at);
            for end in &mut ends {
                *end = landing[*end];
            }
        }
        (text, ends)
    }

    pub(super) fn bytes(&self, id: u32) -> Vec<u8> {
        if let Some(content) = self.added.get(&id) {
            return content.as_bytes().to_vec();
        }
        let Some(token) = self.tokenizer.id_to_token(id) else {
            return Vec::new();
        };
        match &self.spelling {
            Spelling::ByteLevel(alphabet) => {
                let mut bytes = Vec::with_capacity(token.len());
                for c in token.chars() {
                    match alphabet.get(&c) {
                        Some(&byte) => bytes.push(byte),
                        None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                    }
                }
                bytes
            }
            Spelling::Metaspace => {
                let hex = token
                    .strip_prefix("<0x")
                    .and_then(|rest| rest.strip_suffix('>'))
                    .filter(|hex| hex.len() == 2)
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok());
                match hex {
                    Some(byte) => vec![byte],
                    None => token.replace('\u{2581}', " ").into_bytes(),
                }
            }
            Spelling::Decoder => self
                .tokenizer
                .decode(&[id], false)
                .map(String::into_bytes)
                .unwrap_or_else(|_| token.into_bytes()),
        }
    }
}

/// GPT-2's `bytes_to_unicode`, inverted: the character that stands for each byte.
pub(super) fn byte_level_alphabet() -> HashMap<char, u8> {
    let mut alphabet = HashMap::with_capacity(256);
    let mut shifted = 0u32;
    for byte in 0..=255u8 {
        let printable = matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(byte)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
        alphabet.insert(c, byte);
    }
    alphabet
}
