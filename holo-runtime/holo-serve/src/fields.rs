//! Reading request bodies: JSON objects, typed fields, the options both endpoints share.

use super::*;
use holo_core::json::kind_of;

/// The most alternatives per position `logprobs` (completions) and `top_logprobs` (chat) may ask for
/// (vLLM's default `max_logprobs`).
pub(super) const MAX_LOGPROBS: u64 = 20;

/// The most stop strings a request may have, and their most bytes in all: every sample keeps its own
/// copy, and every sampled token is searched for each (OpenAI allows 4 stop strings; vLLM sets no limit).
pub(super) const MAX_STOP_STRINGS: usize = 128;
pub(super) const MAX_STOP_BYTES: usize = 16 << 10;

/// The body's bytes, or why they could not be read (too large, cut short, too slow).
pub(super) fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if BodyTimeout::caused(&rejection) {
            return ApiError::new(StatusCode::REQUEST_TIMEOUT, rejection.body_text())
                .code("request_timeout");
        }
        let status = rejection.status();
        let error = ApiError::new(
            status,
            format!("cannot read the request body: {}", rejection.body_text()),
        );
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            error.code("body_too_large")
        } else {
            error
        }
    })
}

/// The body as a JSON object.
pub(super) fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "the request body must be a JSON object, got {}",
                kind_of(&other)
            ),
        )
        .code("invalid_json")),
        Err(error) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("the request body is not valid JSON: {error}"),
        )
        .code("invalid_json")),
    }
}

pub(super) struct Fields<'a>(pub(super) &'a Map<String, Value>);

impl Fields<'_> {
    /// A field that is present and not `null`.
    pub(super) fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|value| !value.is_null())
    }

    pub(super) fn bool(&self, key: &str, default: bool) -> Result<bool, ApiError> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(value)) => Ok(*value),
            Some(other) => Err(ApiError::invalid(
                key,
                format!("`{key}` must be true or false, got {}", describe(other)),
            )),
        }
    }

    /// An integer in `min..=max`.
    pub(super) fn integer(&self, key: &str, min: u64, max: u64) -> Result<Option<u64>, ApiError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        match value.as_u64() {
            Some(number) if (min..=max).contains(&number) => Ok(Some(number)),
            _ => {
                let range = if max == u64::from(u32::MAX) {
                    format!("an integer ≥ {min}")
                } else {
                    format!("an integer from {min} to {max}")
                };
                Err(ApiError::invalid(
                    key,
                    format!("`{key}` must be {range}, got {}", describe(value)),
                ))
            }
        }
    }

    pub(super) fn number(&self, key: &str) -> Result<Option<f64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => match value.as_f64() {
                Some(number) if number.is_finite() => Ok(Some(number)),
                _ => Err(ApiError::invalid(
                    key,
                    format!("`{key}` must be a number, got {}", describe(value)),
                )),
            },
        }
    }
}

/// What both endpoints share.
pub(super) struct Common {
    /// Completions only: each choice's text (and `logprobs`) starts with its prompt's.
    pub(super) echo: bool,
    /// `Some` when the answer is streamed.
    pub(super) stream: Option<StreamOptions>,
    pub(super) n: u32,
    pub(super) seed: Option<u64>,
    pub(super) params: SampleParams,
    pub(super) include_stop: bool,
    pub(super) token_ids_as_tokens: bool,
    pub(super) return_token_ids: bool,
    pub(super) add_special_tokens: bool,
    /// The request key that asked for `params.constraint`, for errors.
    pub(super) constraint_key: Option<&'static str>,
    /// The format the reply's tool calls are read in (chat requests with tools, unless `tool_choice`
    /// is `"none"`).
    pub(super) tool_format: Option<holo_core::tools::ToolFormat>,
    /// How a chat reply's reasoning is split from its content (`holo serve --reasoning-parser`).
    pub(super) reading: Option<Reading>,
    /// How a gpt-oss reply is read by its harmony channels (instead of `reading`).
    pub(super) harmony: Option<Harmony>,
    /// vLLM's `include_reasoning` (default true): false leaves the reasoning out of the answer.
    pub(super) include_reasoning: bool,
    /// vLLM's `prompt_logprobs`: the most likely tokens to report at each prompt position beside the
    /// prompt's own token.
    pub(super) prompt_logprobs: Option<u32>,
}

pub(super) fn common(fields: &Fields, chat: bool) -> Result<Common, ApiError> {
    let stream = stream_options(fields)?;
    refuse_unsupported(fields, chat)?;
    let n = fields.integer("n", 1, 128)?.unwrap_or(1) as u32;
    if let Some(best_of) = fields.get("best_of") {
        if best_of.as_u64() != Some(u64::from(n)) {
            return Err(ApiError::invalid(
                "best_of",
                format!(
                    "`best_of` other than `n` is not supported (got {}, n = {n})",
                    describe(best_of)
                ),
            )
            .code("unsupported_parameter"));
        }
    }
    // A completion that echoes its prompt may sample nothing after it: a request that only scores the
    // prompt (lm-evaluation-harness' log-likelihoods).
    let echo = !chat && fields.bool("echo", false)?;
    let max_tokens = fields.integer("max_tokens", u64::from(!echo), u64::from(u32::MAX))?;
    let max_tokens = if chat {
        fields
            .integer("max_completion_tokens", 1, u64::from(u32::MAX))?
            .or(max_tokens)
    } else {
        max_tokens
    };
    let temperature = fields.number("temperature")?;
    if let Some(temperature) = temperature {
        if temperature < 0.0 {
            return Err(ApiError::invalid(
                "temperature",
                format!("`temperature` must be ≥ 0, got {temperature}"),
            ));
        }
    }
    let top_p = fields.number("top_p")?;
    if let Some(top_p) = top_p {
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("`top_p` must be in (0, 1], got {top_p}"),
            ));
        }
    }
    let top_k = match fields.get("top_k") {
        None => None,
        Some(value) => match value.as_i64() {
            Some(-1 | 0) => None,
            Some(k) if k >= 1 && k <= i64::from(u32::MAX) => Some(k as u32),
            _ => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!(
                        "`top_k` must be an integer ≥ 1 (or -1 or 0 to turn it off), got {}",
                        describe(value)
                    ),
                ))
            }
        },
    };
    let stop = match fields.get("stop") {
        None => Vec::new(),
        Some(Value::String(stop)) => vec![stop.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| item.as_str().map(str::to_string))
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| {
                ApiError::invalid("stop", "`stop` must be a string or a list of strings")
            })?,
        Some(other) => {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "`stop` must be a string or a list of strings, got {}",
                    describe(other)
                ),
            ))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "`stop` strings must not be empty",
        ));
    }
    let stop_bytes: usize = stop.iter().map(String::len).sum();
    if stop.len() > MAX_STOP_STRINGS || stop_bytes > MAX_STOP_BYTES {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "`stop` has {} strings of {stop_bytes} bytes in all; a request may have at most \
                 {MAX_STOP_STRINGS} stop strings of {MAX_STOP_BYTES} bytes in all",
                stop.len()
            ),
        ));
    }
    let seed = match fields.get("seed") {
        None => None,
        Some(value) => match (value.as_u64(), value.as_i64()) {
            (Some(seed), _) => Some(seed),
            (None, Some(seed)) => Some(seed as u64),
            _ => {
                return Err(ApiError::invalid(
                    "seed",
                    format!("`seed` must be a 64-bit integer, got {}", describe(value)),
                ))
            }
        },
    };
    let logit_bias = logit_bias(fields)?;
    let min_tokens = fields
        .integer("min_tokens", 0, u64::from(u32::MAX))?
        .unwrap_or(0) as u32;
    if let Some(max_tokens) = max_tokens {
        if u64::from(min_tokens) > max_tokens {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("`min_tokens` ({min_tokens}) must not exceed `max_tokens` ({max_tokens})"),
            ));
        }
    }
    let stop_token_ids = token_ids(fields, "stop_token_ids")?;
    let ignore_eos = fields.bool("ignore_eos", false)?;
    let constraint = structured::constraint(fields)?;
    let constraint_key = constraint.as_ref().map(|(key, _)| *key);
    let prompt_logprobs = prompt_logprobs(fields, stream.is_some())?;
    Ok(Common {
        echo,
        constraint_key,
        tool_format: None,
        reading: None,
        harmony: None,
        include_reasoning: !chat || fields.bool("include_reasoning", true)?,
        prompt_logprobs,
        stream,
        n,
        seed,
        params: SampleParams {
            max_tokens: max_tokens.map(|max_tokens| max_tokens as u32),
            temperature,
            top_p,
            top_k,
            stop,
            seed: None,
            top_logprobs: 0,
            constraint: constraint.map(|(_, constraint)| constraint),
            logit_bias,
            min_tokens,
            stop_token_ids,
            ignore_eos,
            prompt_logprobs: None,
            // The server renders chats itself, with the request's `chat_template_kwargs`.
            chat_template_kwargs: None,
        },
        include_stop: fields.bool("include_stop_str_in_output", false)?,
        token_ids_as_tokens: fields.bool("return_tokens_as_token_ids", false)?,
        return_token_ids: fields.bool("return_token_ids", false)?,
        add_special_tokens: fields.bool("add_special_tokens", !chat)?,
    })
}

/// vLLM's `prompt_logprobs`: 0 to [`MAX_LOGPROBS`] (vLLM's `-1`, the whole vocabulary, is beyond its
/// default `max_logprobs` too); not with `stream` unless 0, as vLLM refuses it.
fn prompt_logprobs(fields: &Fields, stream: bool) -> Result<Option<u32>, ApiError> {
    let key = "prompt_logprobs";
    if fields.get(key).and_then(Value::as_i64) == Some(-1) {
        return Err(ApiError::invalid(
            key,
            format!(
                "`{key}` -1 asks for the whole vocabulary at every position; this server reports at most \
                 {MAX_LOGPROBS} (vLLM's default `max_logprobs`)"
            ),
        ));
    }
    let k = fields.integer(key, 0, MAX_LOGPROBS)?.map(|k| k as u32);
    if stream && k.is_some_and(|k| k > 0) {
        return Err(ApiError::invalid(
            key,
            "`prompt_logprobs` are not available when `stream` is true",
        ));
    }
    Ok(k)
}

/// OpenAI's `logit_bias`: `{"token id": bias}`, each bias from -100 to 100, in token-id order.
fn logit_bias(fields: &Fields) -> Result<Vec<(u32, f32)>, ApiError> {
    let key = "logit_bias";
    let Some(value) = fields.get(key) else {
        return Ok(Vec::new());
    };
    let Value::Object(biases) = value else {
        return Err(ApiError::invalid(
            key,
            format!(
                "`{key}` must be an object of token ids to biases, got {}",
                describe(value)
            ),
        ));
    };
    let mut read = Vec::with_capacity(biases.len());
    for (token, bias) in biases {
        let Ok(token) = token.parse::<u32>() else {
            return Err(ApiError::invalid(
                key,
                format!("`{key}` keys must be token ids, got \"{token}\""),
            ));
        };
        match bias.as_f64() {
            Some(bias) if (-100.0..=100.0).contains(&bias) => read.push((token, bias as f32)),
            _ => {
                return Err(ApiError::invalid(
                    key,
                    format!(
                        "`{key}.{token}` must be a number from -100 to 100, got {}",
                        describe(bias)
                    ),
                ))
            }
        }
    }
    read.sort_by_key(|&(token, _)| token);
    Ok(read)
}

/// A list of token ids (vLLM's `stop_token_ids`).
fn token_ids(fields: &Fields, key: &str) -> Result<Vec<u32>, ApiError> {
    let Some(value) = fields.get(key) else {
        return Ok(Vec::new());
    };
    value
        .as_array()
        .and_then(|items| {
            items
                .iter()
                .map(|item| item.as_u64().and_then(|id| u32::try_from(id).ok()))
                .collect::<Option<Vec<u32>>>()
        })
        .ok_or_else(|| {
            ApiError::invalid(
                key,
                format!(
                    "`{key}` must be a list of token ids, got {}",
                    describe(value)
                ),
            )
        })
}

/// `stream_options` of a streamed request.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct StreamOptions {
    /// A last chunk with the usage of the whole request (and `"usage": null` in the others).
    pub(super) include_usage: bool,
    /// (vLLM) Every chunk carries the usage of its choice so far.
    pub(super) continuous_usage_stats: bool,
}

/// `stream` and `stream_options`: `Some` when the answer is streamed.
pub(super) fn stream_options(fields: &Fields) -> Result<Option<StreamOptions>, ApiError> {
    let stream = fields.bool("stream", false)?;
    let options = match fields.get("stream_options") {
        None => return Ok(stream.then(StreamOptions::default)),
        Some(_) if !stream => {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` is only allowed when `stream` is true",
            ))
        }
        Some(Value::Object(options)) => options,
        Some(other) => {
            return Err(ApiError::invalid(
                "stream_options",
                format!(
                    "`stream_options` must be an object, got {}",
                    describe(other)
                ),
            ))
        }
    };
    let flag = |key: &str| match options.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(flag)) => Ok(*flag),
        Some(other) => Err(ApiError::invalid(
            "stream_options",
            format!(
                "`stream_options.{key}` must be a boolean, got {}",
                describe(other)
            ),
        )),
    };
    Ok(Some(StreamOptions {
        include_usage: flag("include_usage")?,
        continuous_usage_stats: flag("continuous_usage_stats")?,
    }))
}

/// Fields the server cannot honour, refused unless neutral (`tools` and `tool_choice` only on
/// `/v1/completions`, and `echo` only on chat: the other endpoint reads them).
pub(super) fn refuse_unsupported(fields: &Fields, chat: bool) -> Result<(), ApiError> {
    for (key, value) in fields.0 {
        let read = match chat {
            true => matches!(key.as_str(), "tools" | "tool_choice"),
            false => key == "echo",
        };
        if value.is_null() || read {
            continue;
        }
        let neutral = match key.as_str() {
            "echo" => *value == Value::Bool(false),
            "suffix" => value.as_str() == Some(""),
            "presence_penalty" | "frequency_penalty" | "min_p" => value.as_f64() == Some(0.0),
            "repetition_penalty" => value.as_f64() == Some(1.0),
            "bad_words" | "tools" => value.as_array().is_some_and(Vec::is_empty),
            "tool_choice" => value.as_str() == Some("none"),
            "guided_whitespace_pattern" | "logits_processors" | "prompt_embeds" => false,
            _ => true,
        };
        if !neutral {
            let message = match key.as_str() {
                "echo" => "`echo` is not supported on /v1/chat/completions: the answer is the reply only; \
                           set `echo` to false"
                    .to_string(),
                "tools" | "tool_choice" => format!(
                    "`{key}` is not supported on /v1/completions: tools are for /v1/chat/completions"
                ),
                _ => format!(
                    "`{key}` is not supported by this server (got {}); leave it out or set it to null",
                    describe(value)
                ),
            };
            return Err(ApiError::invalid(key, message).code("unsupported_parameter"));
        }
    }
    Ok(())
}
