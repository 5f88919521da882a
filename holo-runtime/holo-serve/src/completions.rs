//! `POST /v1/completions`.

use super::*;

pub(super) async fn complete(
    state: &Arc<AppState>,
    tally: &Tally,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let map = parse_object(&body_bytes(body)?)?;
    let fields = Fields(&map);
    let target = state.target(&fields, tally)?;
    let mut common = common(&fields, false)?;
    state.check_sampling(&common)?;
    let logprobs = fields.integer("logprobs", 0, MAX_LOGPROBS)?;
    common.params.top_logprobs = logprobs.unwrap_or(0) as u32;
    if common.echo {
        // As vLLM: the prompt's log-probabilities come with as many alternatives as the completion's.
        common.params.prompt_logprobs = logprobs.map(|k| k as u32);
    }
    if let Some(k) = common.prompt_logprobs.filter(|_| common.stream.is_none()) {
        // One scoring serves both: with the more alternatives of the two.
        common.params.prompt_logprobs = Some(common.params.prompt_logprobs.map_or(k, |e| e.max(k)));
    }
    let Some(prompt) = fields.get("prompt") else {
        return Err(ApiError::invalid("prompt", "`prompt` is required").code("missing_field"));
    };
    let prompts = prompts(state, prompt, common.add_special_tokens)?;
    if prompts.len() * common.n as usize > MAX_SAMPLES {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "{} prompts × n = {} is {} samples; one request may ask for at most {MAX_SAMPLES}",
                prompts.len(),
                common.n,
                prompts.len() * common.n as usize
            ),
        ));
    }
    let mut requests = Vec::with_capacity(prompts.len() * common.n as usize);
    for (index, ids) in prompts.iter().enumerate() {
        if ids.is_empty() {
            let which = if prompts.len() == 1 {
                "the prompt".to_string()
            } else {
                format!("prompt {index}")
            };
            return Err(ApiError::invalid(
                "prompt",
                format!("{which} is empty (no tokens)"),
            ));
        }
        let max_tokens =
            state.budget(ids.len(), common.params.max_tokens, Some(16), "max_tokens")?;
        for j in 0..common.n {
            requests.push(Request {
                prompt: Prompt::Tokens(ids.clone()),
                params: SampleParams {
                    max_tokens,
                    seed: Some(state.sample_seed(common.seed, j)),
                    ..common.params.clone()
                },
            });
        }
    }
    tally.prompt_tokens(prompts.iter().map(Vec::len).sum());
    let echoed = match common.echo {
        true => echoed(state, prompt, &prompts),
        false => Vec::new(),
    };
    if let Some(options) = common.stream {
        let events = state.submit(&target, requests, true, tally)?;
        let endpoint = stream::Endpoint::Completions {
            logprobs: logprobs.is_some(),
        };
        return Ok(stream::respond(
            Arc::clone(state),
            tally,
            &target,
            endpoint,
            common,
            options,
            prompts,
            echoed,
            events,
        ));
    }
    let answers = state.generate_scored(&target, requests, tally).await?;
    let mut choices = Vec::with_capacity(answers.len());
    let mut completion_tokens = 0;
    for (index, (completion, scored)) in answers.iter().enumerate() {
        let prompt_ids = &prompts[index / common.n as usize];
        let out = Choice::new(state, completion, &common)?;
        completion_tokens += out.token_count;
        let (text, logprobs) = match echoed.get(index / common.n as usize) {
            None => (
                out.text.clone(),
                match logprobs {
                    Some(_) => out.completion_logprobs(state, &common),
                    None => Value::Null,
                },
            ),
            Some(echoed) => (
                format!("{echoed}{}", out.text),
                match scored {
                    Some(scored) => out.echo_logprobs(state, &common, prompt_ids, scored),
                    None => Value::Null,
                },
            ),
        };
        let mut choice = json!({
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        });
        if common.return_token_ids {
            choice["token_ids"] = json!(completion.tokens);
            choice["prompt_token_ids"] = json!(prompt_ids);
        }
        if let (Some(k), Some(scored)) = (common.prompt_logprobs, scored) {
            choice["prompt_logprobs"] = prompt_logprobs(state, prompt_ids, scored, k as usize)?;
        }
        choices.push(choice);
    }
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    Ok(Json(json!({
        "id": state.response_id("cmpl", tally),
        "object": "text_completion",
        "created": unix_time(),
        "model": target.name,
        "weight_version": target.version,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, None),
    }))
    .into_response())
}

/// The most samples (prompts × `n`) one completions request may ask for.
pub(super) const MAX_SAMPLES: usize = 4096;

/// An answer's `usage`; with a reasoning parser (`reasoning_tokens`), vLLM's
/// `completion_tokens_details.reasoning_tokens` too.
pub(super) fn usage(
    prompt_tokens: usize,
    completion_tokens: usize,
    reasoning_tokens: Option<usize>,
) -> Value {
    let mut usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });
    if let Some(reasoning_tokens) = reasoning_tokens {
        usage["completion_tokens_details"] = json!({"reasoning_tokens": reasoning_tokens});
    }
    usage
}

/// The text each prompt of a completions request echoes (`echo`): a prompt given as text is itself, one
/// given as token ids their tokens' text, special tokens included (as vLLM decodes them), where the
/// echoed `text_offset`s count.
fn echoed(state: &AppState, prompt: &Value, ids: &[Vec<u32>]) -> Vec<String> {
    match prompt {
        Value::String(text) => vec![text.clone()],
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .map(|item| item.as_str().unwrap_or_default().to_string())
            .collect(),
        _ => ids
            .iter()
            .map(|ids| {
                let bytes: Vec<u8> = ids.iter().flat_map(|&id| state.vocab.bytes(id)).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .collect(),
    }
}

/// The prompts of a completions request as token ids.
pub(super) fn prompts(
    state: &AppState,
    prompt: &Value,
    add_special_tokens: bool,
) -> Result<Vec<Vec<u32>>, ApiError> {
    const SHAPE: &str =
        "`prompt` must be a string, a list of strings, a list of token ids, or a list of token-id lists";
    let shape =
        |got: &Value| ApiError::invalid("prompt", format!("{SHAPE}, got {}", describe(got)));
    let ids = |items: &[Value], which: &str| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .map(|item| {
                let id = item
                    .as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "prompt",
                            format!(
                                "{which}: token ids must be non-negative integers, got {}",
                                describe(item)
                            ),
                        )
                    })?;
                if id >= state.vocab.size {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!(
                            "{which}: token id {id} is out of the vocabulary (size {})",
                            state.vocab.size
                        ),
                    ));
                }
                Ok(id)
            })
            .collect()
    };
    match prompt {
        Value::String(text) => Ok(vec![state.tokenize(text, add_special_tokens, "prompt")?]),
        Value::Array(items) if items.is_empty() => Err(ApiError::invalid(
            "prompt",
            "`prompt` must not be an empty list",
        )),
        Value::Array(items) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|item| match item {
                    Value::String(text) => state.tokenize(text, add_special_tokens, "prompt"),
                    other => Err(shape(other)),
                })
                .collect(),
            Value::Number(_) => Ok(vec![ids(items, "`prompt`")?]),
            Value::Array(_) => items
                .iter()
                .enumerate()
                .map(|(index, item)| match item {
                    Value::Array(list) => ids(list, &format!("`prompt[{index}]`")),
                    other => Err(shape(other)),
                })
                .collect(),
            other => Err(shape(other)),
        },
        other => Err(shape(other)),
    }
}
