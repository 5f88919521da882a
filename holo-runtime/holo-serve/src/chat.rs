//! `POST /v1/chat/completions`.

use super::*;

/// The parts of a chat body that go to the template as they are, keys in their order.
#[derive(Deserialize)]
pub(super) struct TemplateInputs {
    #[serde(default)]
    pub(super) messages: Option<Vec<minijinja::Value>>,
    #[serde(default)]
    pub(super) chat_template_kwargs: Option<minijinja::Value>,
}

pub(super) async fn chat(
    state: &Arc<AppState>,
    tally: &Tally,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let raw = body_bytes(body)?;
    let map = parse_object(&raw)?;
    let fields = Fields(&map);
    let target = state.target(&fields, tally)?;
    let mut common = common(&fields, true)?;
    let tool_request = tool_request(state, &fields)?;
    if let Some(request) = &tool_request {
        if let Some(constraint) = &request.constraint {
            if let Some(key) = common.constraint_key {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "`tool_choice` forces a tool call and `{key}` another form: give one of them"
                    ),
                ));
            }
            common.params.constraint = Some(constraint.clone());
            common.constraint_key = Some("tool_choice");
        }
        common.tool_format = request.format;
    }
    // A forced tool call and a Lark grammar of the client's hold the reply from its first token: a
    // forced call's grammar writes the whole reply (a harmony call is a harmony message, read by its
    // channels; other formats have no reasoning to split out), and a client's grammar cannot be nested
    // in another. Other structured output starts after the reasoning, as vLLM starts it: with harmony's
    // reading in the `final` message, after any `analysis` messages; with `</think>` after it, when
    // the model thinks.
    let gpt_oss = state.reasoning_parser == Some(ReasoningParser::GptOss);
    if gpt_oss || state.tool_format == Some(ToolFormat::Harmony) {
        let harmony = Some(Harmony { reasoning: gpt_oss });
        match (&common.params.constraint, common.constraint_key) {
            (None, _) | (Some(_), Some("tool_choice")) => common.harmony = harmony,
            (Some(constraint), key) => {
                let token_id = |marker: &str| state.tokenizer.token_to_id(marker);
                if let Some(after) = structured::after_analysis(constraint, token_id) {
                    let after = after.map_err(|error| {
                        ApiError::invalid(
                            key.unwrap_or("response_format"),
                            format!("cannot hold the reply's final message: {error}"),
                        )
                    })?;
                    common.params.constraint = Some(after);
                    common.harmony = harmony;
                }
            }
        }
    } else if let Some(reading) = state
        .reasoning_parser
        .and_then(|parser| parser.reading(fields.get("chat_template_kwargs")))
    {
        match (&common.params.constraint, common.constraint_key) {
            (None, _) => common.reading = Some(reading),
            (Some(_), Some("tool_choice")) => {}
            (Some(_), _) if !reading.thinking => common.reading = Some(reading),
            (Some(constraint), _) => {
                if let Some(after) = structured::after_reasoning(constraint, reasoning::END) {
                    common.params.constraint = Some(after);
                    common.reading = Some(reading);
                }
            }
        }
    }
    // Streams carry no prompt log-probabilities (vLLM's neither): a streamed 0 asks for nothing.
    common.params.prompt_logprobs = common.prompt_logprobs.filter(|_| common.stream.is_none());
    state.check_sampling(&common)?;
    let logprobs = fields.bool("logprobs", false)?;
    let top_logprobs = fields.integer("top_logprobs", 0, MAX_LOGPROBS)?;
    if top_logprobs.is_some() && !logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` needs `logprobs` set to true",
        ));
    }
    common.params.top_logprobs = top_logprobs.unwrap_or(0) as u32;
    let add_generation_prompt = fields.bool("add_generation_prompt", true)?;
    let continue_final_message = fields.bool("continue_final_message", false)?;
    if add_generation_prompt && continue_final_message {
        return Err(ApiError::invalid(
            "continue_final_message",
            "`continue_final_message` continues the final message and `add_generation_prompt` starts a new \
             one: set `add_generation_prompt` to false to continue",
        ));
    }
    let messages = match fields.get("messages") {
        None => {
            return Err(
                ApiError::invalid("messages", "`messages` is required").code("missing_field")
            )
        }
        Some(Value::Array(messages)) if messages.is_empty() => {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must not be empty",
            ))
        }
        Some(Value::Array(messages)) => messages,
        Some(other) => {
            return Err(ApiError::invalid(
                "messages",
                format!(
                    "`messages` must be a list of messages, got {}",
                    describe(other)
                ),
            ))
        }
    };
    let mut contents = Vec::with_capacity(messages.len());
    let mut calls = Vec::with_capacity(messages.len());
    for (index, message) in messages.iter().enumerate() {
        let Value::Object(message) = message else {
            return Err(ApiError::invalid(
                "messages",
                format!(
                    "`messages[{index}]` must be an object, got {}",
                    describe(message)
                ),
            ));
        };
        match message.get("role") {
            Some(Value::String(_)) => {}
            Some(other) => {
                return Err(ApiError::invalid(
                    "messages",
                    format!(
                        "`messages[{index}].role` must be a string, got {}",
                        describe(other)
                    ),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    "messages",
                    format!("`messages[{index}].role` is required"),
                ))
            }
        }
        let tool_calls = match message.get("tool_calls") {
            None | Some(Value::Null) => None,
            Some(tool_calls) => Some(history_calls(tool_calls, index)?),
        };
        // A message that only calls tools has `content: null` from OpenAI's clients; templates test
        // and split its content as a string (Qwen3's `'</think>' in message.content`), so it is one,
        // empty, as vLLM renders it.
        contents.push(match (message.get("content"), &tool_calls) {
            (None | Some(Value::Null), Some(_)) => minijinja::Value::from(""),
            (given, _) => content(given, index)?,
        });
        calls.push(tool_calls);
    }
    if let Some(kwargs) = fields.get("chat_template_kwargs") {
        if !kwargs.is_object() {
            return Err(ApiError::invalid(
                "chat_template_kwargs",
                format!(
                    "`chat_template_kwargs` must be an object, got {}",
                    describe(kwargs)
                ),
            ));
        }
    }
    // The same JSON again, as template values that keep the keys' order.
    let inputs: TemplateInputs = serde_json::from_slice(&raw).map_err(|error| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("the request body is not valid JSON: {error}"),
        )
        .code("invalid_json")
    })?;
    let values = inputs.messages.unwrap_or_default();
    let mut rendered_messages = Vec::with_capacity(values.len());
    for ((value, content), calls) in values.iter().zip(contents).zip(calls) {
        let keys: Vec<minijinja::Value> =
            value.try_iter().map(Iterator::collect).unwrap_or_default();
        let pairs: Vec<(minijinja::Value, minijinja::Value)> = keys
            .into_iter()
            .map(|key| {
                let item = match (key.as_str(), &calls) {
                    (Some("content"), _) => content.clone(),
                    (Some("tool_calls"), Some(calls)) => calls.clone(),
                    _ => value.get_item(&key).unwrap_or_default(),
                };
                (key, item)
            })
            .collect();
        rendered_messages.push(minijinja::Value::from_pairs(pairs));
    }
    let mut variables = BTreeMap::new();
    if let Some(kwargs) = inputs.chat_template_kwargs {
        if let Ok(keys) = kwargs.try_iter() {
            for key in keys {
                if let Some(name) = key.as_str() {
                    variables.insert(name.to_string(), kwargs.get_item(&key).unwrap_or_default());
                }
            }
        }
    }
    let options = RenderOptions {
        add_generation_prompt,
        continue_final_message,
        variables,
        tools: tool_request.map(|request| request.tools),
        ..RenderOptions::default()
    };
    let text = state
        .template
        .render_values(rendered_messages, &options)
        .map_err(|error| {
            ApiError::invalid(
                "messages",
                format!("cannot apply the chat template: {error}"),
            )
            .code("chat_template_error")
        })?;
    let prompt_ids = state.tokenize(&text, common.add_special_tokens, "messages")?;
    if prompt_ids.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "the rendered conversation is empty (no tokens)",
        ));
    }
    let max_tokens = state.budget(
        prompt_ids.len(),
        common.params.max_tokens,
        None,
        "max_tokens",
    )?;
    let requests = (0..common.n)
        .map(|j| Request {
            prompt: Prompt::Tokens(prompt_ids.clone()),
            params: SampleParams {
                max_tokens,
                seed: Some(state.sample_seed(common.seed, j)),
                ..common.params.clone()
            },
        })
        .collect();
    tally.prompt_tokens(prompt_ids.len());
    if let Some(options) = common.stream {
        let events = state.submit(&target, requests, true, tally)?;
        let endpoint = stream::Endpoint::Chat { logprobs };
        return Ok(stream::respond(
            Arc::clone(state),
            tally,
            &target,
            endpoint,
            common,
            options,
            vec![prompt_ids],
            Vec::new(),
            events,
        ));
    }
    let answers = state.generate_scored(&target, requests, tally).await?;
    // As vLLM: with the reasoning left out, so are the per-token details that would show it.
    let hidden = state.reasoning_parser.is_some() && !common.include_reasoning;
    let mut choices = Vec::with_capacity(answers.len());
    let mut completion_tokens = 0;
    let mut reasoning_tokens = state.reasoning_parser.map(|_| 0);
    for (index, (completion, _)) in answers.iter().enumerate() {
        let out = Choice::new(state, completion, &common)?;
        completion_tokens += out.token_count;
        if let (Some(sum), Some(count)) = (&mut reasoning_tokens, out.reasoning_tokens) {
            *sum += count;
        }
        // No content: none after the reasoning, or only calls.
        let calls_only = out.text.is_empty() && !out.tool_calls.is_empty();
        let content = match out.has_content && !calls_only {
            true => json!(out.text),
            false => Value::Null,
        };
        let mut message = json!({"role": "assistant", "content": content});
        if !out.tool_calls.is_empty() {
            message["tool_calls"] = json!(calls_json(state, &out.tool_calls));
        }
        if state.reasoning_parser.is_some() {
            message["reasoning"] = match common.include_reasoning {
                true => json!(out.reasoning),
                false => Value::Null,
            };
        }
        let mut choice = json!({
            "index": index,
            "message": message,
            "logprobs": match logprobs && !hidden {
                true => out.chat_logprobs(state, &common),
                false => Value::Null,
            },
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        });
        if common.return_token_ids && !hidden {
            choice["token_ids"] = json!(completion.tokens);
        }
        choices.push(choice);
    }
    let mut answer = json!({
        "id": state.response_id("chatcmpl", tally),
        "object": "chat.completion",
        "created": unix_time(),
        "model": target.name,
        "weight_version": target.version,
        "choices": choices,
        "usage": usage(prompt_ids.len(), completion_tokens, reasoning_tokens),
    });
    if common.return_token_ids {
        answer["prompt_token_ids"] = json!(prompt_ids);
    }
    // vLLM's chat answers carry the prompt's log-probabilities once, beside the choices.
    if let (Some(k), Some((_, Some(scored)))) = (common.prompt_logprobs, answers.first()) {
        answer["prompt_logprobs"] = prompt_logprobs(state, &prompt_ids, scored, k as usize)?;
    }
    Ok(Json(answer).into_response())
}

/// A message's content as the template sees it: a string, `none`, or text parts joined with newlines.
pub(super) fn content(content: Option<&Value>, index: usize) -> Result<minijinja::Value, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(minijinja::Value::from(())),
        Some(Value::String(text)) => Ok(minijinja::Value::from(text.as_str())),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (part_index, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text")) {
                    (Some("text"), Some(Value::String(text))) => texts.push(text.as_str()),
                    (Some("text"), _) => {
                        return Err(ApiError::invalid(
                            "messages",
                            format!("`messages[{index}].content[{part_index}].text` must be a string"),
                        ))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::invalid(
                            "messages",
                            format!(
                                "`messages[{index}].content[{part_index}]`: only text parts are supported, \
                                 got type `{other}`"
                            ),
                        )
                        .code("unsupported_parameter"))
                    }
                    (None, _) => {
                        return Err(ApiError::invalid(
                            "messages",
                            format!(
                                "`messages[{index}].content[{part_index}]` must be an object with `type` \
                                 \"text\" and a `text`"
                            ),
                        ))
                    }
                }
            }
            Ok(minijinja::Value::from(texts.join("\n")))
        }
        Some(other) => Err(ApiError::invalid(
            "messages",
            format!(
                "`messages[{index}].content` must be a string, null or a list of text parts, got {}",
                describe(other)
            ),
        )),
    }
}
