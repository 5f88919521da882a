//! A finished rollout as NeMo Gym's verify response: the row, the Responses-API `response` with the
//! token ids and log-probabilities of every sampled turn, `reward` and `reward_components`; see
//! "Responses" in the [module documentation](super).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use holo_core::loom::{ContextRecord, RolloutRecord};
use holo_core::sampler::Imposed;
use holo_core::Role;

/// One sampled turn of a trained context: what the model saw and what it sampled, exactly.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The context's token ids before the turn (chat-template frames included).
    pub prompt_token_ids: Vec<u32>,
    pub generation_token_ids: Vec<u32>,
    /// The sampler's log-probability of each generated token.
    pub generation_log_probs: Vec<f32>,
    /// The turn's text as the sampler returned it.
    pub text: String,
}

/// An output item of the response, in transcript order.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// A sampled turn: an assistant message carrying its tokens.
    Turn(Turn),
    /// A message the holoware wrote between two turns (a tool's result, a follow-up question).
    Message { role: Role, text: String },
}

/// The output items of a rollout's trained context; an error when the rollout has no single trained
/// context or its tokens are not exactly what was sampled.
pub fn items(record: &RolloutRecord) -> Result<Vec<Item>, String> {
    let trained: Vec<&ContextRecord> = record
        .contexts
        .iter()
        .filter(|context| context.trained)
        .collect();
    let context = match trained.as_slice() {
        [] => return Ok(Vec::new()),
        [context] => *context,
        several => {
            return Err(format!(
                "the rollout has {} trained contexts; a NeMo Gym response is one token sequence \
                 (holowares with several trained contexts, such as ERL's, are not served by `holo gym`)",
                several.len()
            ))
        }
    };
    let tokens = context.tokens.as_ref().ok_or(
        "the rollout has no token record (the server needs the policy's tokenizer: --model)",
    )?;
    if tokens.retokenized {
        return Err(
            "the policy answered without token ids, so the tokens of its text are not exactly \
             what it sampled (an OpenAI-compatible server must honour `return_tokens_as_token_ids` \
             and `logprobs`, as vLLM, SGLang and `holo serve` do)"
                .into(),
        );
    }
    // The sampled spans of the ids: runs of the loss mask.
    let mut spans = Vec::new();
    let mut start = None;
    for (position, &mask) in tokens.loss_mask.iter().chain([&0]).enumerate() {
        match (mask == 1, start) {
            (true, None) => start = Some(position),
            (false, Some(from)) => {
                spans.push(from..position);
                start = None;
            }
            _ => {}
        }
    }
    // The sampled texts: runs of sampled parts, and the messages between them.
    let mut texts: Vec<String> = Vec::new();
    let mut between: Vec<Vec<(Role, String)>> = vec![Vec::new()];
    for message in &context.messages {
        let mut in_run = false;
        let mut written = String::new();
        for part in &message.parts {
            if part.sampled {
                if in_run {
                    texts.last_mut().expect("in a run").push_str(&part.text);
                } else {
                    texts.push(part.text.clone());
                    between.push(Vec::new());
                    in_run = true;
                }
            } else if !part.text.is_empty() {
                in_run = false;
                if message.role != Role::Assistant {
                    written.push_str(&part.text);
                }
            }
        }
        if !written.is_empty() && !texts.is_empty() {
            between
                .last_mut()
                .expect("one list per turn and one before")
                .push((message.role, written));
        }
    }
    if spans.len() != texts.len() {
        return Err(format!(
            "cannot align the rollout's {} sampled texts with the {} sampled spans of its tokens",
            texts.len(),
            spans.len()
        ));
    }
    let mut items = Vec::new();
    for ((span, text), messages) in spans
        .into_iter()
        .zip(texts)
        .zip(between.into_iter().skip(1))
    {
        items.push(Item::Turn(Turn {
            prompt_token_ids: tokens.ids[..span.start].to_vec(),
            generation_token_ids: tokens.ids[span.clone()].to_vec(),
            generation_log_probs: tokens.logprobs[span].to_vec(),
            text,
        }));
        items.extend(
            messages
                .into_iter()
                .map(|(role, text)| Item::Message { role, text }),
        );
    }
    // Messages after the last turn are not output: nothing was sampled after them.
    while matches!(items.last(), Some(Item::Message { .. })) {
        items.pop();
    }
    Ok(items)
}

/// The Responses-API object of a rollout's items: `model` is the policy's model name, the sampling
/// parameters are those the row imposed.
pub fn response(items: &[Item], model: &str, imposed: &Imposed, truncated: bool) -> Value {
    let output: Vec<Value> = items
        .iter()
        .map(|item| match item {
            Item::Turn(turn) => json!({
                "id": new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": turn.text, "annotations": []}],
                "prompt_token_ids": turn.prompt_token_ids,
                "generation_token_ids": turn.generation_token_ids,
                "generation_log_probs": turn.generation_log_probs,
            }),
            Item::Message { role, text } => json!({
                "type": "message",
                "role": role,
                "status": "completed",
                "content": [{"type": "input_text", "text": text}],
            }),
        })
        .collect();
    let turns = || {
        items.iter().filter_map(|item| match item {
            Item::Turn(turn) => Some(turn),
            Item::Message { .. } => None,
        })
    };
    // As NeMo Gym's agents sum the usage of their model calls: every call's prompt, every
    // call's generation.
    let input_tokens: usize = turns().map(|turn| turn.prompt_token_ids.len()).sum();
    let output_tokens: usize = turns().map(|turn| turn.generation_token_ids.len()).sum();
    let mut response = json!({
        "id": new_id("resp"),
        "object": "response",
        "created_at": SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |elapsed| elapsed.as_secs_f64()),
        "model": model,
        "status": if truncated { "incomplete" } else { "completed" },
        "output": output,
        "parallel_tool_calls": false,
        "tool_choice": "auto",
        "tools": [],
        "temperature": imposed.temperature,
        "top_p": imposed.top_p,
        "max_output_tokens": imposed.max_tokens,
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
    });
    if truncated {
        response["incomplete_details"] = json!({"reason": "max_output_tokens"});
    }
    response
}

/// The verify response: the row as it came, with `response`, `reward` (the rollout's weighted total)
/// and `reward_components` (each component's value, as `BaseMultiRewardVerifyResponse` has them).
pub fn verify_response(row: &Map<String, Value>, record: &RolloutRecord, response: Value) -> Value {
    let mut answer = row.clone();
    answer.insert("response".into(), response);
    answer.insert("reward".into(), json!(record.reward));
    answer.insert("reward_components".into(), json!(record.rewards));
    Value::Object(answer)
}

/// `PREFIX_` and 32 hex digits, unique in the process and unlikely to repeat across processes.
fn new_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let start = *START.get_or_init(|| {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_nanos() as u64);
        holo_core::loom::mix(nanos ^ u64::from(std::process::id()) << 32)
    });
    let count = NEXT.fetch_add(1, Ordering::Relaxed);
    format!(
        "{prefix}_{:016x}{:016x}",
        holo_core::loom::mix(start ^ count),
        holo_core::loom::mix(!start ^ count)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use holo_core::loom::{MessageRecord, PartRecord, TokensRecord};
    use std::collections::BTreeMap;

    fn part(text: &str, sampled: bool) -> PartRecord {
        PartRecord {
            text: text.into(),
            sampled,
            weight_version: None,
        }
    }

    fn record(contexts: Vec<ContextRecord>) -> RolloutRecord {
        RolloutRecord {
            dataset: None,
            row_index: 0,
            rollout_index: 0,
            seed: 0,
            row: Default::default(),
            contexts,
            rewards: BTreeMap::from([("exact".to_string(), 1.0), ("short".to_string(), 0.5)]),
            weights: BTreeMap::new(),
            feedback: BTreeMap::new(),
            reward: 1.5,
            samples: 2,
            truncated: false,
            step: None,
            error: None,
            timing: None,
        }
    }

    /// user "q" (ids 10 11), assistant "a" sampled (12 13), user "sure?" (14 15), assistant "b" (16),
    /// a footer (17).
    fn two_turns() -> ContextRecord {
        ContextRecord {
            trained: true,
            tools: Vec::new(),
            messages: vec![
                MessageRecord {
                    role: Role::User,
                    parts: vec![part("q", false)],
                    tool: None,
                },
                MessageRecord {
                    role: Role::Assistant,
                    parts: vec![part("a", true)],
                    tool: None,
                },
                MessageRecord {
                    role: Role::User,
                    parts: vec![part("sure?", false)],
                    tool: None,
                },
                MessageRecord {
                    role: Role::Assistant,
                    parts: vec![part("", false), part("b", true)],
                    tool: None,
                },
            ],
            tokens: Some(TokensRecord {
                ids: vec![10, 11, 12, 13, 14, 15, 16, 17],
                loss_mask: vec![0, 0, 1, 1, 0, 0, 1, 0],
                logprobs: vec![0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0, 0.0],
                retokenized: false,
                routes: None,
                constraints: Vec::new(),
            }),
        }
    }

    #[test]
    fn each_sampled_turn_is_an_item_with_its_context_before_it() {
        let items = items(&record(vec![two_turns()])).unwrap();
        assert_eq!(
            items,
            vec![
                Item::Turn(Turn {
                    prompt_token_ids: vec![10, 11],
                    generation_token_ids: vec![12, 13],
                    generation_log_probs: vec![-0.5, -0.25],
                    text: "a".into()
                }),
                Item::Message {
                    role: Role::User,
                    text: "sure?".into()
                },
                Item::Turn(Turn {
                    prompt_token_ids: vec![10, 11, 12, 13, 14, 15],
                    generation_token_ids: vec![16],
                    generation_log_probs: vec![-1.0],
                    text: "b".into()
                }),
            ]
        );
        let response = response(&items, "tiny", &Imposed::default(), false);
        assert_eq!(response["output"].as_array().unwrap().len(), 3);
        assert_eq!(response["output"][0]["role"], "assistant");
        assert_eq!(response["output"][1]["content"][0]["type"], "input_text");
        assert_eq!(response["usage"]["input_tokens"], 8);
        assert_eq!(response["usage"]["output_tokens"], 3);
        assert_eq!(response["status"], "completed");
        let answer = verify_response(
            json!({"responses_create_params": {"input": "q"}})
                .as_object()
                .unwrap(),
            &record(vec![two_turns()]),
            response,
        );
        assert_eq!(answer["reward"], 1.5);
        assert_eq!(
            answer["reward_components"],
            json!({"exact": 1.0, "short": 0.5})
        );
        assert_eq!(answer["responses_create_params"]["input"], "q");
    }

    #[test]
    fn untrustworthy_tokens_and_several_contexts_are_refused() {
        let mut retokenized = two_turns();
        retokenized.tokens.as_mut().unwrap().retokenized = true;
        let error = items(&record(vec![retokenized])).unwrap_err();
        assert!(error.contains("without token ids"), "{error}");
        let error = items(&record(vec![two_turns(), two_turns()])).unwrap_err();
        assert!(error.contains("2 trained contexts"), "{error}");
        let mut untrained = two_turns();
        untrained.trained = false;
        assert_eq!(items(&record(vec![untrained])).unwrap(), vec![]);
    }
}
