//! `holo train --rollouts atropos`: the trainer registers with an Atropos API and trains on its
//! batches ([`AtroposFeed`], a [`Feed`]) instead of rolling out itself.
//!
//! - **Registration** (`POST /register`) on the first batch: `batch_size` is the run's
//!   `generation_batch_size` (one `/batch` is one generation), `max_token_len` the model's context,
//!   `num_steps` its `max_steps` (required: the environments decide the data), `checkpoint_dir` the run
//!   folder, `save_checkpoint_interval` its `save_steps`, `starting_step` the step it starts (or
//!   resumes) at. `GET /info` must then report that batch size: an API another trainer registered
//!   first (with its own) is refused.
//! - **Batches** (`GET /batch`): polled every `poll` while the API has none. Each scored group becomes
//!   one rollout record per sequence ([`records`]), written to `RUN_DIR/rollouts.jsonl` like the
//!   Loom's. Groups need not have `num_generations` sequences: `run-api` packs the groups of
//!   environments with different group sizes into one batch (and releases the smaller groups an
//!   environment posts, once they add up to its group size, one by one), so the trainer normalizes
//!   advantages within each group of its own size. A group may fix them instead:
//!   `overrides[i].set_advantage_to_zero`, or `advantages`, one per token, aligned with `tokens` as
//!   `masks` is (constant over a sequence's trained tokens: one advantage for the sequence; varying:
//!   one per trained token, which the loss weighs token by token, and which a loss that needs one per
//!   sequence refuses before training, naming the group and the field:
//!   [`per_token_advantages_refused`]). The sampler is corrected for with `inference_logprobs` as for
//!   any external sampler.
//! - **Failures**: an API that does not answer at the start is an error naming it; one that goes away
//!   later is waited for (`reconnect_timeout`); one that answers that the trainer is not registered
//!   (it restarted) gets the registration again, with the current step. A malformed batch is an error
//!   naming the group and the field.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::api::{reply, Api, ApiError, Info, Registration, Retry, ScoredData, MASKED};
use holo_core::interpreter::Row;
use holo_core::loom::{
    ContextRecord, MessageRecord, PartRecord, RolloutRecord, RolloutSource, TokensRecord,
    ToolCallRecord, ToolRecord,
};
use holo_core::machine::Rollout;
use holo_core::Role;
use holo_train::feed::{Fed, Feed, Given};
use holo_train::loss::per_token_advantages_refused;
use holo_train::ppo::Algorithm;
use holo_train::{GrpoConfig, TrainError};

/// The reward component that holds an Atropos score in the records.
pub const SCORE: &str = "score";

/// How the trainer reaches the API.
#[derive(Debug, Clone, PartialEq)]
pub struct FeedOptions {
    /// Retries of one request ([`Retry`]).
    pub retry: Retry,
    /// The wait between two `/batch` requests while the API has no batch (default 1 s, as
    /// `example_trainer`).
    pub poll: Duration,
    /// How long the API may be gone in the middle of a run before the trainer gives up (default 5 min).
    pub reconnect_timeout: Duration,
}

impl Default for FeedOptions {
    fn default() -> Self {
        FeedOptions {
            retry: Retry::default(),
            poll: Duration::from_secs(1),
            reconnect_timeout: Duration::from_secs(300),
        }
    }
}

/// A trainer's batches from an Atropos API; see the [module documentation](self).
pub struct AtroposFeed {
    api: Api,
    options: FeedOptions,
    registration: Registration,
    registered: bool,
    /// Why this run's loss cannot take advantages that vary over a sequence's tokens, if it cannot.
    per_token_refusal: Option<String>,
    vocab: usize,
    run_dir: PathBuf,
    /// Groups received so far: the records' row indices.
    groups: usize,
}

impl AtroposFeed {
    /// A feed of the API at `url` for a run of `config` on a model with `vocab` tokens and a context of
    /// `context` tokens, writing into `run_dir`. Refuses the options that need rows of the trainer's own
    /// (a curriculum, DAPO's dynamic sampling, ERL) and a run without `max_steps`.
    pub fn new(
        url: &str,
        config: &GrpoConfig,
        vocab: usize,
        context: usize,
        run_dir: &Path,
        options: FeedOptions,
    ) -> Result<AtroposFeed, String> {
        let api =
            Api::new(url, options.retry.clone()).map_err(|message| format!("--api: {message}"))?;
        if config.training.max_steps <= 0 {
            return Err(
                "`max_steps`: --rollouts atropos needs it (the environments decide the data, so there are no epochs to count)".into(),
            );
        }
        for (key, set) in [
            ("erl", config.erl),
            ("dynamic_sampling", config.dynamic_sampling),
            ("difficulty_column", config.difficulty_column.is_some()),
        ] {
            if set {
                return Err(format!(
                    "`{key}`: not with --rollouts atropos (the environments decide which rollouts a batch holds)"
                ));
            }
        }
        Ok(AtroposFeed {
            api,
            registration: Registration {
                wandb_group: String::new(),
                wandb_project: String::new(),
                batch_size: config.generation_batch_size() as i64,
                max_token_len: context as i64,
                checkpoint_dir: run_dir.display().to_string(),
                save_checkpoint_interval: config.training.save_steps as i64,
                starting_step: 0,
                num_steps: config.training.max_steps,
            },
            options,
            registered: false,
            // PPO makes its own advantages (GAE) and uses none of the environments'.
            per_token_refusal: match config.algorithm {
                Algorithm::Ppo => None,
                _ => per_token_advantages_refused(config),
            },
            vocab,
            run_dir: run_dir.to_path_buf(),
            groups: 0,
        })
    }

    /// `POST /register`, then `GET /info` to check that the API serves this trainer's batch size. With
    /// a `deadline`, an API that does not answer is tried again until then.
    async fn register(&mut self, step: u64, deadline: Option<Instant>) -> Result<(), ApiError> {
        self.registration.starting_step = step.saturating_sub(1) as i64;
        let body = serde_json::to_value(&self.registration).expect("a registration serializes");
        let answer = loop {
            match self.api.post("/register", &body).await {
                Ok(answer) => break answer,
                Err(error)
                    if error.is_transient() && deadline.is_some_and(|end| Instant::now() < end) =>
                {
                    tokio::time::sleep(self.options.poll).await;
                }
                Err(error) => return Err(error),
            }
        };
        if answer.get("uuid").is_none() {
            return Err(ApiError::Malformed {
                url: format!("{}/register", self.api.url()),
                message: format!("{answer} (no `uuid`)"),
            });
        }
        let info: Info = reply(&self.api, "/info", self.api.get("/info").await?)?;
        if info.batch_size < 0 {
            return Err(ApiError::Malformed {
                url: format!("{}/info", self.api.url()),
                message: "no batch size after /register: the API took data before any trainer registered (atroposlib sets a trainer up only while its queue is missing); restart it".into(),
            });
        }
        if info.batch_size != self.registration.batch_size {
            return Err(ApiError::Malformed {
                url: format!("{}/info", self.api.url()),
                message: format!(
                    "batches of {} sequences: another trainer registered first; restart the API, or set generation_batch_size to {}",
                    info.batch_size, info.batch_size
                ),
            });
        }
        self.registered = true;
        Ok(())
    }

    async fn fetch(&mut self, step: u64) -> Result<Fed, TrainError> {
        let source = |error: ApiError| TrainError::Source(error.to_string());
        if !self.registered {
            self.register(step, None).await.map_err(source)?;
        }
        let started = Instant::now();
        let mut failing_since: Option<Instant> = None;
        loop {
            let answer = match self.api.get("/batch").await {
                Ok(answer) => answer,
                Err(error) if error.is_transient() => {
                    let since = *failing_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= self.options.reconnect_timeout {
                        return Err(TrainError::Source(format!(
                            "{error}; gone for {} s (the reconnection's limit)",
                            self.options.reconnect_timeout.as_secs()
                        )));
                    }
                    tokio::time::sleep(self.options.poll).await;
                    continue;
                }
                Err(error) => return Err(source(error)),
            };
            failing_since = None;
            if answer.get("status").and_then(Value::as_str) == Some("error") {
                // A restarted API forgot the trainer: register again, as it was.
                eprintln!(
                    "the Atropos API at {} answered {answer}; registering again at step {step}",
                    self.api.url()
                );
                let deadline = Instant::now() + self.options.reconnect_timeout;
                self.register(step, Some(deadline)).await.map_err(source)?;
                continue;
            }
            match answer.get("batch") {
                Some(Value::Array(items)) => {
                    let mut fed = self.batch(items, step)?;
                    fed.metrics
                        .insert("atropos/wait_time".into(), started.elapsed().as_secs_f64());
                    return Ok(fed);
                }
                Some(Value::Null) => tokio::time::sleep(self.options.poll).await,
                _ => {
                    return Err(TrainError::Source(format!(
                        "the Atropos API at {}/batch answered {answer}, not a batch",
                        self.api.url()
                    )))
                }
            }
        }
    }

    /// A `/batch` as the trainer's records, written to `RUN_DIR/rollouts.jsonl`.
    fn batch(&mut self, items: &[Value], step: u64) -> Result<Fed, TrainError> {
        let url = format!("{}/batch", self.api.url());
        let malformed = |group: usize, message: String| {
            TrainError::Source(format!("{url}: group {group}: {message}"))
        };
        let mut fed = Fed::default();
        for (index, item) in items.iter().enumerate() {
            let scored =
                ScoredData::from_json(item).map_err(|message| malformed(index, message))?;
            let (records, given) = records(
                &scored,
                &Limits {
                    vocab: self.vocab,
                    context: self.registration.max_token_len as usize,
                    per_token_refusal: self.per_token_refusal.as_deref(),
                },
                self.groups + index,
                step,
            )
            .map_err(|message| malformed(index, message))?;
            fed.groups.push(records.len());
            fed.records.extend(records);
            fed.advantages.extend(given);
        }
        let wanted = self.registration.batch_size as usize;
        if fed.records.len() != wanted {
            return Err(TrainError::Source(format!(
                "{url}: {} sequences, but a generation batch is {wanted}",
                fed.records.len()
            )));
        }
        self.groups += items.len();
        fed.metrics
            .insert("atropos/groups".into(), items.len() as f64);
        let mut lines = Vec::new();
        for record in &fed.records {
            serde_json::to_writer(&mut lines, record).map_err(std::io::Error::other)?;
            lines.push(b'\n');
        }
        let mut out = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(self.run_dir.join("rollouts.jsonl"))?;
        out.write_all(&lines)?;
        out.flush()?;
        Ok(fed)
    }
}

impl Feed for AtroposFeed {
    fn next(&mut self, runtime: &tokio::runtime::Runtime, step: u64) -> Result<Fed, TrainError> {
        runtime.block_on(self.fetch(step))
    }
}

/// What a group is checked against: the trained model and its loss.
#[derive(Debug, Clone, Copy)]
pub struct Limits<'a> {
    /// The model's vocabulary: token ids are below it.
    pub vocab: usize,
    /// The model's context: no sequence is longer.
    pub context: usize,
    /// Why the loss cannot take advantages that vary over a sequence's trained tokens, if it cannot
    /// ([`per_token_advantages_refused`]).
    pub per_token_refusal: Option<&'a str>,
}

/// A scored group as rollout records (row `row`, one per sequence, reward component [`SCORE`]) and the
/// advantages it fixes, after checking every field against `tokens` and `limits`; an error names the
/// field and the sequence.
pub fn records(
    scored: &ScoredData,
    limits: &Limits<'_>,
    row: usize,
    step: u64,
) -> Result<(Vec<RolloutRecord>, Vec<Option<Given>>), String> {
    check(scored, limits.vocab, limits.context)?;
    let env = scored.env_id.map_or(Value::Null, |id| json!(id));
    let mut records = Vec::with_capacity(scored.len());
    let mut fixed = Vec::with_capacity(scored.len());
    for (i, (tokens, masks)) in scored.tokens.iter().zip(&scored.masks).enumerate() {
        let trained: Vec<bool> = masks
            .iter()
            .enumerate()
            .map(|(position, &mask)| mask != MASKED && position > 0)
            .collect();
        let logprobs: Vec<f32> = (0..tokens.len())
            .map(|position| {
                let value = scored
                    .inference_logprobs
                    .as_ref()
                    .map_or(0.0, |all| all[i][position]);
                // Log-probabilities are ≤ 0: the 1.0 placeholder (or anything positive) says "none",
                // which the records write as 0.
                if trained[position] && value <= 0.0 {
                    value as f32
                } else {
                    0.0
                }
            })
            .collect();
        let overridden = scored
            .overrides
            .as_ref()
            .and_then(|overrides| overrides[i].get("set_advantage_to_zero"))
            .and_then(Value::as_bool)
            == Some(true);
        let given = match &scored.advantages {
            Some(advantages) => {
                let values: Vec<f64> = trained
                    .iter()
                    .zip(&advantages[i])
                    .filter(|(trained, _)| **trained)
                    .map(|(_, &value)| value)
                    .collect();
                match values.first() {
                    Some(&first) if values.iter().any(|&value| value != first) => {
                        if let Some(refusal) = limits.per_token_refusal {
                            return Err(format!(
                                "`advantages[{i}]` varies over the trained tokens, and {refusal}"
                            ));
                        }
                        Some(Given::Tokens(
                            values.iter().map(|&value| value as f32).collect(),
                        ))
                    }
                    first => first.map(|&value| Given::Sequence(value)),
                }
            }
            None => None,
        };
        fixed.push(if overridden {
            Some(Given::Sequence(0.0))
        } else {
            given
        });
        let messages = scored
            .messages
            .as_ref()
            .map(|messages| {
                messages[i]
                    .iter()
                    .map(|message| {
                        let role = match message.get("role").and_then(Value::as_str) {
                            Some("system") => Role::System,
                            Some("assistant") => Role::Assistant,
                            // `user`, and what the environment says otherwise (`tool`).
                            _ => Role::User,
                        };
                        let text = match message.get("content") {
                            Some(Value::String(text)) => text.clone(),
                            Some(other) => other.to_string(),
                            None => String::new(),
                        };
                        MessageRecord {
                            role,
                            parts: vec![PartRecord {
                                text,
                                sampled: role == Role::Assistant,
                                weight_version: None,
                            }],
                            tool: tool_record(message),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        let score = scored.scores[i];
        records.push(RolloutRecord {
            dataset: Some("atropos".into()),
            row_index: row,
            rollout_index: i,
            seed: 0,
            row: Row::from_iter([("env_id".to_string(), env.clone())]),
            contexts: vec![ContextRecord {
                trained: true,
                messages,
                tools: Vec::new(),
                tokens: Some(TokensRecord {
                    ids: tokens.iter().map(|&id| id as u32).collect(),
                    loss_mask: trained.iter().map(|&trained| u8::from(trained)).collect(),
                    logprobs,
                    retokenized: false,
                    routes: None,
                    constraints: Vec::new(),
                }),
            }],
            rewards: BTreeMap::from([(SCORE.to_string(), score)]),
            weights: BTreeMap::from([(SCORE.to_string(), 1.0)]),
            feedback: BTreeMap::new(),
            reward: score,
            samples: 1,
            truncated: false,
            step: Some(step),
            error: None,
            timing: None,
        });
    }
    Ok((records, fixed))
}

/// Every per-sequence list has one entry per sequence, every per-token list one per token; token ids
/// are the model's, sequences fit its context, and a mask is `-100` or its token.
fn check(scored: &ScoredData, vocab: usize, context: usize) -> Result<(), String> {
    let count = scored.tokens.len();
    if count == 0 {
        return Err("no sequences (`tokens` is empty)".into());
    }
    let per_sequence = |name: &str, len: Option<usize>| match len {
        Some(len) if len != count => Err(format!(
            "`{name}` has {len} entries for {count} sequences (`tokens`)"
        )),
        _ => Ok(()),
    };
    per_sequence("masks", Some(scored.masks.len()))?;
    per_sequence("scores", Some(scored.scores.len()))?;
    per_sequence(
        "inference_logprobs",
        scored.inference_logprobs.as_ref().map(Vec::len),
    )?;
    per_sequence("advantages", scored.advantages.as_ref().map(Vec::len))?;
    per_sequence("overrides", scored.overrides.as_ref().map(Vec::len))?;
    per_sequence("messages", scored.messages.as_ref().map(Vec::len))?;
    for (i, tokens) in scored.tokens.iter().enumerate() {
        if tokens.is_empty() {
            return Err(format!("`tokens[{i}]` is empty"));
        }
        if tokens.len() > context {
            return Err(format!(
                "`tokens[{i}]` has {} tokens; the model's context is {context}",
                tokens.len()
            ));
        }
        if let Some((position, id)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &id)| id < 0 || id as usize >= vocab)
        {
            return Err(format!(
                "`tokens[{i}][{position}]` = {id} is not a token of the model's vocabulary of {vocab}"
            ));
        }
        let per_token = |name: &str, len: Option<usize>| match len {
            Some(len) if len != tokens.len() => Err(format!(
                "`{name}[{i}]` has {len} entries, `tokens[{i}]` {}",
                tokens.len()
            )),
            _ => Ok(()),
        };
        per_token("masks", Some(scored.masks[i].len()))?;
        per_token(
            "inference_logprobs",
            scored.inference_logprobs.as_ref().map(|all| all[i].len()),
        )?;
        per_token(
            "advantages",
            scored.advantages.as_ref().map(|all| all[i].len()),
        )?;
        if let Some((position, (mask, token))) = scored.masks[i]
            .iter()
            .zip(tokens)
            .enumerate()
            .find(|(_, (&mask, &token))| mask != MASKED && mask != token)
        {
            return Err(format!(
                "`masks[{i}][{position}]` = {mask} is neither -100 nor its token ({token})"
            ));
        }
        if !scored.scores[i].is_finite() {
            return Err(format!("`scores[{i}]` is not a finite number"));
        }
    }
    Ok(())
}

/// The rollout source of a trainer fed by Atropos with no holoware of its own: it has no rollouts (and
/// so no held-out evaluation).
pub struct NoHoloware;

const NO_HOLOWARE: &str = "this trainer has no holoware: its rollouts come from the Atropos API";

impl RolloutSource for NoHoloware {
    fn check(&self, _row: &Row) -> Result<(), String> {
        Err(NO_HOLOWARE.into())
    }

    fn start(&self, _row: &Row) -> Result<Box<dyn Rollout + Send>, String> {
        Err(NO_HOLOWARE.into())
    }
}

/// What an OpenAI message an environment sent is to tool calls: an assistant message's `tool_calls`
/// (arguments given as JSON text are read back into objects) with their ids, or a `tool` message's
/// function `name` and `tool_call_id`.
fn tool_record(message: &serde_json::Map<String, Value>) -> Option<ToolRecord> {
    match message.get("role").and_then(Value::as_str) {
        Some("tool") => Some(ToolRecord::Result {
            name: message
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            id: message
                .get("tool_call_id")
                .and_then(Value::as_str)
                .map(str::to_string),
        }),
        Some("assistant") => {
            let calls = message.get("tool_calls")?.as_array()?;
            Some(ToolRecord::ToolCalls {
                content: message
                    .get("content")
                    .and_then(Value::as_str)
                    .filter(|text| !text.trim().is_empty())
                    .map(str::to_string),
                calls: calls
                    .iter()
                    .map(|call| {
                        let function = call.get("function").unwrap_or(call);
                        let arguments = match function.get("arguments") {
                            Some(Value::String(text)) => serde_json::from_str(text)
                                .unwrap_or_else(|_| Value::String(text.clone())),
                            Some(other) => other.clone(),
                            None => json!({}),
                        };
                        ToolCallRecord {
                            name: function
                                .get("name")
                                .and_then(Value::as_str)
                                .unwrap_or_default()
                                .to_string(),
                            arguments,
                            id: call.get("id").and_then(Value::as_str).map(str::to_string),
                        }
                    })
                    .collect(),
                reasoning: None,
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An environment's OpenAI messages keep their tool calls (arguments sent as JSON text read back
    /// into objects) and their tool results' function names in the records.
    #[test]
    fn openai_tool_messages_become_tool_records() {
        let object = |value: Value| value.as_object().unwrap().clone();
        let calling = object(json!({"role": "assistant", "content": " ", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}
        ]}));
        assert_eq!(
            tool_record(&calling),
            Some(ToolRecord::ToolCalls {
                content: None,
                calls: vec![ToolCallRecord {
                    name: "add".into(),
                    arguments: json!({"a": 2}),
                    id: Some("c1".into()),
                }],
                reasoning: None,
            })
        );
        let result =
            object(json!({"role": "tool", "name": "add", "tool_call_id": "c1", "content": "4"}));
        assert_eq!(
            tool_record(&result),
            Some(ToolRecord::Result {
                name: "add".into(),
                id: Some("c1".into())
            })
        );
        let plain = object(json!({"role": "assistant", "content": "4"}));
        assert_eq!(tool_record(&plain), None);
    }

    fn group() -> ScoredData {
        ScoredData {
            tokens: vec![vec![5, 6, 7, 8], vec![5, 6, 9, 3]],
            masks: vec![vec![-100, -100, 7, 8], vec![-100, -100, 9, 3]],
            scores: vec![1.0, 0.0],
            inference_logprobs: Some(vec![
                vec![1.0, 1.0, -0.5, -0.25],
                vec![1.0, 1.0, -2.0, -0.1],
            ]),
            env_id: Some(3),
            ..ScoredData::default()
        }
    }

    const LIMITS: Limits<'static> = Limits {
        vocab: 16,
        context: 8,
        per_token_refusal: None,
    };

    #[test]
    fn a_group_becomes_records_with_masks_and_logprobs_aligned() {
        let (records, fixed) = records(&group(), &LIMITS, 7, 2).unwrap();
        assert_eq!(fixed, vec![None, None]);
        let tokens = records[0].contexts[0].tokens.as_ref().unwrap();
        assert_eq!(tokens.ids, vec![5, 6, 7, 8]);
        assert_eq!(tokens.loss_mask, vec![0, 0, 1, 1]);
        assert_eq!(tokens.logprobs, vec![0.0, 0.0, -0.5, -0.25]);
        assert_eq!(records[1].rewards[SCORE], 0.0);
        assert_eq!((records[1].row_index, records[1].rollout_index), (7, 1));
        assert_eq!(records[0].step, Some(2));
        assert_eq!(records[0].row["env_id"], 3);
        // What the loss trains on: the trained positions and their sampling log-probabilities.
        let sequence = holo_train::batch::sequence(&records[0].contexts[0]).unwrap();
        assert_eq!(sequence.trained, vec![2, 3]);
        assert_eq!(sequence.sampling_logprobs, vec![-0.5, -0.25]);
    }

    #[test]
    fn fixed_advantages_come_from_overrides_and_the_advantages_of_the_trained_tokens() {
        let mut scored = group();
        scored.overrides = Some(vec![
            serde_json::Map::new(),
            serde_json::Map::from_iter([("set_advantage_to_zero".to_string(), json!(true))]),
        ]);
        // Position by position as `masks`: only positions 2 and 3 are trained.
        scored.advantages = Some(vec![vec![9.0, 9.0, 0.5, 0.5], vec![0.0, 0.0, 1.0, 1.0]]);
        let (_, fixed) = records(&scored, &LIMITS, 0, 1).unwrap();
        assert_eq!(
            fixed,
            vec![Some(Given::Sequence(0.5)), Some(Given::Sequence(0.0))]
        );
        scored.advantages = Some(vec![vec![9.0, 9.0, 0.5, 0.25], vec![0.0; 4]]);
        let (_, fixed) = records(&scored, &LIMITS, 0, 1).unwrap();
        assert_eq!(
            fixed,
            vec![
                Some(Given::Tokens(vec![0.5, 0.25])),
                Some(Given::Sequence(0.0))
            ]
        );
        let refusing = Limits {
            per_token_refusal: Some("GSPO takes one per sequence"),
            ..LIMITS
        };
        let error = records(&scored, &refusing, 0, 1).unwrap_err();
        assert_eq!(
            error,
            "`advantages[0]` varies over the trained tokens, and GSPO takes one per sequence"
        );
    }

    #[test]
    fn malformed_groups_name_the_field() {
        type Break = fn(&mut ScoredData);
        let cases: [(Break, &str); 7] = [
            (
                |s| {
                    *s = ScoredData::default();
                },
                "no sequences (`tokens` is empty)",
            ),
            (
                |s| {
                    s.scores.pop();
                },
                "`scores` has 1 entries for 2 sequences (`tokens`)",
            ),
            (
                |s| s.masks[1].push(-100),
                "`masks[1]` has 5 entries, `tokens[1]` 4",
            ),
            (
                |s| s.masks[0][2] = 9,
                "`masks[0][2]` = 9 is neither -100 nor its token (7)",
            ),
            (
                |s| s.tokens[1][0] = 16,
                "`tokens[1][0]` = 16 is not a token of the model's vocabulary of 16",
            ),
            (
                |s| {
                    s.inference_logprobs.as_mut().unwrap()[0].pop();
                },
                "`inference_logprobs[0]` has 3 entries, `tokens[0]` 4",
            ),
            (
                |s| s.tokens[0].extend([1; 5]),
                "`tokens[0]` has 9 tokens; the model's context is 8",
            ),
        ];
        for (break_it, expected) in cases {
            let mut scored = group();
            break_it(&mut scored);
            assert_eq!(records(&scored, &LIMITS, 0, 1).unwrap_err(), expected);
        }
    }
}
