//! A Holoware environment as an Atropos environment (`holo atropos-env`): it registers with the API,
//! rolls each data row's `G` rollouts out through the [`Loom`] against an OpenAI-compatible policy,
//! and posts them as scored groups, throttled as `atroposlib`'s `BaseEnv` throttles.
//!
//! The life of a run, step by step as `BaseEnv.env_manager` takes it:
//! 1. **Register** (`POST /register-env`), again every second while the API answers `"wait for trainer
//!    to start"` (the trainer has not asked for its first batch yet). Then `GET /info` gives the
//!    trainer's `batch_size` and `max_token_len`; a `group_size` larger than `batch_size` is refused.
//! 2. **Throttle**: `GET /status-env` before each round. The run ends once `current_step +
//!    queue_size · group_size / batch_size` passes the total steps (the registration's `num_steps`
//!    unless given); no group is started while `queue_size · group_size ≥ max_batches_offpolicy ·
//!    batch_size` (the trainer is that many batches behind); otherwise up to `min(max_workers,
//!    max_batches_offpolicy · batch_size / group_size − queue_size)` rows are rolled out together.
//!    With a `min_batch_allocation` (or other environments' shares), `BaseEnv`'s adjustments apply:
//!    see `throttle`. `queue_size` counts the other environments' groups too, so with several
//!    environments the queue's room is shared.
//! 3. **Score and post**: each row's rollouts become one group ([`scored_group`]) posted to
//!    `/scored_data` with the environment's id. As `BaseEnv` does, a group is dropped (and counted)
//!    when a rollout failed, when its scores are all equal (unless `keep_equal_scores`), or when a
//!    sequence reaches the trainer's `max_token_len`.
//!
//! Rows are taken in order and the data starts over when it runs out; each rollout's seed comes from
//! the run seed and its place in that stream, so a second pass over a row samples anew.
//!
//! When the API goes away (no answer, an HTTP 5xx, or `/status-env` failing because a restarted API
//! no longer knows this environment), the groups not yet delivered are kept, the environment registers
//! again (a new `env_id`) as soon as the API and its trainer are back, and posts them then; the run
//! fails, naming the API, only when that takes longer than `reconnect_timeout`. Groups the old API
//! had queued are gone with it: that queue lived in its memory.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::api::{
    reply, Api, ApiError, EnvRegistered, EnvStatus, Info, Object, RegisterEnv, ScoredData, MASKED,
    MASKED_LOGPROB,
};
use holo_core::holophore::Holophore;
use holo_core::interpreter::{Holoware, Row};
use holo_core::loom::{Loom, LoomConfig, RolloutRecord};
use holo_core::resources::Resources;
use holo_core::sampler::{Imposed, Sampler, WithImposed};

/// How the environment registers and throttles; the defaults are `BaseEnvConfig`'s.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvOptions {
    /// `G`: rollouts per row, the sequences of one group (default 4).
    pub group_size: usize,
    /// The name the API gives the environment (`desired_name`; it appends `_N`).
    pub name: String,
    /// The environment's share of the policy server's attention (`inference_weight`, default 1).
    pub weight: f64,
    /// The longest sequence the environment makes (`max_token_length`, default 2048).
    pub max_token_length: i64,
    /// The share of every batch this environment is guaranteed, or none (`min_batch_allocation`).
    pub min_batch_allocation: Option<f64>,
    /// Batches the queue may hold before generation pauses (default 3).
    pub max_batches_offpolicy: i64,
    /// Rows rolled out at once, at most (`max_num_workers_per_node`, default 8).
    pub max_workers: usize,
    /// Steps after which the environment stops; the registration's `num_steps` when `None`.
    pub total_steps: Option<i64>,
    /// The sampling temperature of every request (sent as `generation_params`; default 1).
    pub temperature: f64,
    /// Post groups whose scores are all equal (`BaseEnv` drops them: `ensure_scores_are_not_same`).
    pub keep_equal_scores: bool,
    /// The run seed of every rollout's sampling seed.
    pub seed: u64,
    /// Rollouts of one round in flight at once (the Loom's concurrency).
    pub concurrency: usize,
    /// The wait between two looks at a full queue, and between registrations while the trainer has
    /// not started (default 1 s).
    pub poll: Duration,
    /// How long the API may be gone in the middle of a run before the environment gives up (default
    /// 5 min).
    pub reconnect_timeout: Duration,
}

impl Default for EnvOptions {
    fn default() -> Self {
        EnvOptions {
            group_size: 4,
            name: "holoware".into(),
            weight: 1.0,
            max_token_length: 2048,
            min_batch_allocation: None,
            max_batches_offpolicy: 3,
            max_workers: 8,
            total_steps: None,
            temperature: 1.0,
            keep_equal_scores: false,
            seed: 0,
            concurrency: 64,
            poll: Duration::from_secs(1),
            reconnect_timeout: Duration::from_secs(300),
        }
    }
}

/// What a run of the environment did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EnvSummary {
    /// Groups the API received.
    pub posted: usize,
    /// Groups dropped because a rollout failed.
    pub failed: usize,
    /// Groups dropped because their scores were all equal.
    pub equal_scores: usize,
    /// Groups dropped because a sequence reached the trainer's `max_token_len`.
    pub too_long: usize,
    /// The mean score of the posted groups' sequences.
    pub mean_score: Option<f64>,
    /// Registrations after the first (the API went away and came back).
    pub reregistrations: usize,
}

/// Why the environment stopped before its last step.
#[derive(Debug)]
pub enum EnvError {
    /// The API failed for good.
    Api(ApiError),
    /// The environment's own input is wrong (the options, a holoware whose rollouts do not fit).
    Input(String),
}

impl std::fmt::Display for EnvError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EnvError::Api(error) => error.fmt(f),
            EnvError::Input(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for EnvError {}

impl From<ApiError> for EnvError {
    fn from(error: ApiError) -> Self {
        EnvError::Api(error)
    }
}

/// Why a row's rollouts give no group to post.
#[derive(Debug, Clone, PartialEq)]
pub enum Dropped {
    /// A rollout failed.
    Failed,
    /// Every score is the same.
    EqualScores,
    /// A sequence has this many tokens, the trainer's `max_token_len` or more.
    TooLong(usize),
}

/// The environment's rollouts: a holoware, its resources, the Holophore that records tokens, the
/// policy, and the rows (`(line number, row)`, taken in turn).
pub struct Rollouts<'a> {
    pub holoware: Arc<Holoware>,
    pub resources: Resources,
    pub holophore: Holophore,
    pub policy: &'a dyn Sampler,
    pub rows: &'a [(usize, Row)],
}

/// Where the run is with the API: the registration's facts and the trainer's.
#[derive(Debug, Clone)]
struct Session {
    env_id: i64,
    total_steps: i64,
    batch_size: i64,
    max_token_len: i64,
}

/// Runs the environment until the trainer has enough steps queued; see the [module
/// documentation](self).
pub async fn run(
    api: &Api,
    rollouts: &Rollouts<'_>,
    options: &EnvOptions,
) -> Result<EnvSummary, EnvError> {
    if options.group_size == 0 || options.max_workers == 0 || rollouts.rows.is_empty() {
        return Err(EnvError::Input(
            "the environment needs a group size and workers of at least 1, and rows".into(),
        ));
    }
    let mut session = register(api, options, None).await?;
    eprintln!(
        "registered with the Atropos API at {} as environment {}: batches of {} sequences, {} steps",
        api.url(),
        session.env_id,
        session.batch_size,
        session.total_steps
    );
    let mut summary = EnvSummary::default();
    let mut score_sum = (0.0, 0usize);
    let mut pending: VecDeque<ScoredData> = VecDeque::new();
    let mut next_item = 0usize;
    loop {
        // The status first: it fails on a restarted API, which must be registered with again before
        // it takes a group (see `Api::post_registered`).
        let status: EnvStatus = match api
            .get_with_body("/status-env", &json!({"env_id": session.env_id}))
            .await
            .and_then(|value| reply(api, "/status-env", value))
        {
            Ok(status) => status,
            Err(error) if error.is_transient() => {
                session = reconnect(api, options, error).await?;
                summary.reregistrations += 1;
                continue;
            }
            Err(error) => return Err(error.into()),
        };
        if !pending.is_empty() {
            while let Some(scored) = pending.front_mut() {
                scored.env_id = Some(session.env_id);
                let body = serde_json::to_value(&*scored).expect("scored data serializes");
                match api.post_registered("/scored_data", &body).await {
                    Ok(_) => {
                        score_sum.0 += scored.scores.iter().sum::<f64>();
                        score_sum.1 += scored.scores.len();
                        summary.posted += 1;
                        pending.pop_front();
                    }
                    Err(error) if error.is_transient() => {
                        session = reconnect(api, options, error).await?;
                        summary.reregistrations += 1;
                        break;
                    }
                    Err(error) => return Err(error.into()),
                }
            }
            // The queue grew: look at it again before deciding.
            continue;
        }
        let items = match throttle(&status, options, session.batch_size, session.total_steps) {
            Throttle::Stop => break,
            Throttle::Wait => {
                tokio::time::sleep(options.poll).await;
                continue;
            }
            Throttle::RollOut(items) => items,
        };
        let round: Vec<(usize, Row)> = (next_item..next_item + items)
            .map(|item| (item, rollouts.rows[item % rollouts.rows.len()].1.clone()))
            .collect();
        next_item += items;
        let records = roll_out(rollouts, options, &round).await?;
        for records in records.chunk_by(|a, b| a.row_index == b.row_index) {
            let line = rollouts.rows[records[0].row_index % rollouts.rows.len()].0;
            let scored = scored_group(records, options.temperature)
                .map_err(|message| EnvError::Input(format!("row {line}: {message}")))?;
            match keep(&scored, options.keep_equal_scores, session.max_token_len) {
                Ok(()) => pending.push_back(scored),
                Err(Dropped::Failed) => {
                    summary.failed += 1;
                    let failure = records.iter().find_map(|record| record.error.as_ref());
                    eprintln!(
                        "row {line}: a rollout failed ({}); group dropped",
                        failure.map_or("?", |failure| failure.message.as_str())
                    );
                }
                Err(Dropped::EqualScores) => summary.equal_scores += 1,
                Err(Dropped::TooLong(length)) => {
                    summary.too_long += 1;
                    eprintln!(
                        "row {line}: a sequence of {length} tokens reaches the trainer's max_token_len {}; group dropped",
                        session.max_token_len
                    );
                }
            }
        }
    }
    if let Err(error) = api
        .post("/disconnect-env", &json!({"env_id": session.env_id}))
        .await
    {
        eprintln!("warning: {error}");
    }
    summary.mean_score = (score_sum.1 > 0).then(|| score_sum.0 / score_sum.1 as f64);
    Ok(summary)
}

/// What the environment does after a look at the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Throttle {
    /// The queue holds enough for the trainer's last step.
    Stop,
    /// The queue is full: look again after `poll`.
    Wait,
    /// Roll this many rows out.
    RollOut(usize),
}

/// `BaseEnv.env_manager`'s rules (`atroposlib` 0.4.0), on the queue as `/status-env` shows it to
/// this environment, a trainer taking batches of `batch` sequences, and `total_steps`:
/// - stop once `current_step + queue_size · G / batch` passes `total_steps`;
/// - wait while `queue_size · G ≥ max_batches_offpolicy · batch`, unless the environment has a
///   `min_batch_allocation` and fewer of its own groups queued than its share of that many batches
///   (`⌈share · batch · max_batches_offpolicy / M⌉ · ⌊M / G⌋`, `M` the largest group queued);
///   without that exception, the others' groups would fill the queue and keep out the groups every
///   batch must hold;
/// - else roll `min(max_workers, max_batches_offpolicy · derived / G − queue_size)` rows out, where
///   `derived = ⌊batch · (unallocated_fraction + share)⌋` is the part of a batch this environment
///   may fill (`derived_batch_size`), and with a share at least enough rows to refill its own
///   (`add_train_workers`' `min_workers_to_fill_self_queue`).
fn throttle(status: &EnvStatus, options: &EnvOptions, batch: i64, total_steps: i64) -> Throttle {
    let group = options.group_size as i64;
    let offpolicy = options.max_batches_offpolicy;
    if status.current_step + status.queue_size * group / batch > total_steps {
        return Throttle::Stop;
    }
    let largest = status.max_group_size.max(1);
    // Packs of the largest group size this environment's share of `offpolicy` batches takes.
    let packs = options
        .min_batch_allocation
        .map(|share| (share * (batch * offpolicy) as f64 / largest as f64).ceil() as i64);
    let short_of_share =
        packs.is_some_and(|packs| packs * (largest / group) - status.self_queue_size > 0);
    if status.queue_size * group >= offpolicy * batch && !short_of_share {
        return Throttle::Wait;
    }
    let share = options.min_batch_allocation.unwrap_or(0.0);
    let derived = (batch as f64 * (status.unallocated_fraction + share)) as i64;
    let mut items =
        (options.max_workers as i64).min(offpolicy * derived / group - status.queue_size);
    if let Some(packs) = packs {
        let own = status.self_queue_size * group;
        let refill =
            (((packs + largest / group) * largest - own) as f64 / group as f64).ceil() as i64;
        items = items.max(refill);
    }
    if items <= 0 {
        Throttle::Wait
    } else {
        Throttle::RollOut(items as usize)
    }
}

/// Registers (again every `poll` while the trainer has not started) and reads the trainer's batch
/// size. With a `deadline`, the API may also be unreachable until then.
async fn register(
    api: &Api,
    options: &EnvOptions,
    deadline: Option<Instant>,
) -> Result<Session, EnvError> {
    let body = serde_json::to_value(RegisterEnv {
        max_token_length: options.max_token_length,
        desired_name: options.name.clone(),
        weight: options.weight,
        group_size: options.group_size as i64,
        min_batch_allocation: options.min_batch_allocation,
    })
    .expect("a registration serializes");
    let mut waiting_noted = false;
    let registered: EnvRegistered = loop {
        let answer = match api.post("/register-env", &body).await {
            Ok(answer) => answer,
            Err(error)
                if error.is_transient() && deadline.is_some_and(|end| Instant::now() < end) =>
            {
                tokio::time::sleep(options.poll).await;
                continue;
            }
            Err(error) => return Err(error.into()),
        };
        match answer.get("status").and_then(Value::as_str) {
            Some("success") => break reply(api, "/register-env", answer)?,
            status => {
                if !waiting_noted {
                    eprintln!(
                        "waiting for the trainer to start (/register-env answered {})",
                        status.unwrap_or("without a status")
                    );
                    waiting_noted = true;
                }
                if deadline.is_some_and(|end| Instant::now() >= end) {
                    return Err(EnvError::Api(ApiError::Malformed {
                        url: format!("{}/register-env", api.url()),
                        message: format!(
                            "{answer} until the reconnection's deadline: no trainer came back"
                        ),
                    }));
                }
                tokio::time::sleep(options.poll).await;
            }
        }
    };
    let info: Info = reply(api, "/info", api.get("/info").await?)?;
    if info.batch_size <= 0 {
        return Err(EnvError::Input(format!(
            "the Atropos API at {} has no trainer's batch size (/info: {})",
            api.url(),
            info.batch_size
        )));
    }
    if options.group_size as i64 > info.batch_size {
        return Err(EnvError::Input(format!(
            "group_size ({}) must be less than batch_size ({}), the trainer's",
            options.group_size, info.batch_size
        )));
    }
    let total_steps = options.total_steps.unwrap_or(registered.num_steps);
    if total_steps < 0 {
        return Err(EnvError::Input(
            "total steps not set by the options or the trainer's registration".into(),
        ));
    }
    Ok(Session {
        env_id: registered.env_id,
        total_steps,
        batch_size: info.batch_size,
        max_token_len: info.max_token_len,
    })
}

/// Registers again after the API failed with `error`, waiting at most `reconnect_timeout` for it.
async fn reconnect(api: &Api, options: &EnvOptions, error: ApiError) -> Result<Session, EnvError> {
    eprintln!("{error}; registering again once it is back");
    let deadline = Instant::now() + options.reconnect_timeout;
    match register(api, options, Some(deadline)).await {
        Ok(session) => {
            eprintln!("registered again as environment {}", session.env_id);
            Ok(session)
        }
        Err(EnvError::Api(last)) => Err(EnvError::Api(ApiError::Unreachable {
            url: api.url().to_string(),
            message: format!(
                "not back within {} s ({last})",
                options.reconnect_timeout.as_secs()
            ),
        })),
        Err(other) => Err(other),
    }
}

/// `G` rollouts of each row of a round through the Loom, grouped: row by row, rollouts in order.
async fn roll_out(
    rollouts: &Rollouts<'_>,
    options: &EnvOptions,
    round: &[(usize, Row)],
) -> Result<Vec<RolloutRecord>, EnvError> {
    let loom = Loom::interpreted(
        Arc::clone(&rollouts.holoware),
        rollouts.resources.clone(),
        LoomConfig {
            rollouts_per_row: options.group_size,
            seed: options.seed,
            concurrency: options.concurrency.max(1),
            progress: false,
            timing: false,
            ..LoomConfig::default()
        },
    )
    .with_holophore(rollouts.holophore.fork());
    let policy = WithImposed {
        inner: rollouts.policy,
        imposed: Imposed {
            temperature: Some(options.temperature),
            ..Imposed::default()
        },
    };
    let mut records: Vec<RolloutRecord> = Vec::new();
    let summary = loom
        .run(round, &policy, &mut records)
        .await
        .map_err(|error| EnvError::Input(format!("cannot record the rollouts: {error}")))?;
    if let Some(failure) = summary.row_failures.first() {
        let line = rollouts.rows[failure.row_index % rollouts.rows.len()].0;
        return Err(EnvError::Input(format!("row {line}: {}", failure.message)));
    }
    records.sort_by_key(|record| (record.row_index, record.rollout_index));
    Ok(records)
}

/// One row's rollouts as a scored group: per rollout, its trained context's tokens, the mask of the
/// sampled ones, its total reward as the score, the sampler's log-probabilities (when every trained
/// token has one) and the messages. A failed rollout gives an empty sequence and `NaN` for its
/// score, for [`keep`] to drop; a rollout with other than one trained context is an error.
pub fn scored_group(records: &[RolloutRecord], temperature: f64) -> Result<ScoredData, String> {
    let mut scored = ScoredData {
        messages: Some(Vec::with_capacity(records.len())),
        generation_params: Some(Object::from_iter([(
            "temperature".to_string(),
            json!(temperature),
        )])),
        ..ScoredData::default()
    };
    let mut logprobs: Option<Vec<Vec<f64>>> = Some(Vec::with_capacity(records.len()));
    for record in records {
        if record.error.is_some() {
            scored.tokens.push(Vec::new());
            scored.masks.push(Vec::new());
            scored.scores.push(f64::NAN);
            logprobs = None;
            continue;
        }
        let trained: Vec<_> = record
            .contexts
            .iter()
            .filter(|context| context.trained)
            .collect();
        let context = match trained.as_slice() {
            [context] => *context,
            [] => return Err(format!("rollout {} has no trained context", record.rollout_index)),
            several => {
                return Err(format!(
                    "rollout {} has {} trained contexts; an Atropos sequence is one trained context (see `holo atropos-env --help`)",
                    record.rollout_index,
                    several.len()
                ))
            }
        };
        let tokens = context.tokens.as_ref().ok_or_else(|| {
            format!(
                "rollout {} has no token record (the environment needs the model's tokenizer)",
                record.rollout_index
            )
        })?;
        let trained_at = |position: usize| tokens.loss_mask.get(position) == Some(&1);
        scored
            .tokens
            .push(tokens.ids.iter().map(|&id| i64::from(id)).collect());
        scored.masks.push(
            tokens
                .ids
                .iter()
                .enumerate()
                .map(|(position, &id)| {
                    if trained_at(position) {
                        i64::from(id)
                    } else {
                        MASKED
                    }
                })
                .collect(),
        );
        scored.scores.push(record.reward);
        let aligned: Option<Vec<f64>> = (!tokens.retokenized)
            .then(|| {
                (0..tokens.ids.len())
                    .map(|position| match tokens.logprobs.get(position) {
                        _ if !trained_at(position) => Some(MASKED_LOGPROB),
                        // The holophore writes 0 where the sampler gave no log-probability.
                        Some(&logprob) if logprob != 0.0 => Some(f64::from(logprob)),
                        _ => None,
                    })
                    .collect()
            })
            .flatten();
        logprobs = logprobs.zip(aligned).map(|(mut all, one)| {
            all.push(one);
            all
        });
        let messages = scored.messages.as_mut().expect("set above");
        messages.push(
            context
                .messages
                .iter()
                .map(|message| {
                    let content: String = message
                        .parts
                        .iter()
                        .map(|part| part.text.as_str())
                        .collect();
                    Object::from_iter([
                        ("role".to_string(), json!(message.role)),
                        ("content".to_string(), json!(content)),
                    ])
                })
                .collect(),
        );
    }
    scored.inference_logprobs = logprobs;
    Ok(scored)
}

/// Whether `BaseEnv` would post the group: no failed rollout, scores that differ (unless
/// `keep_equal_scores`), and every sequence shorter than the trainer's `max_token_len` (when it has
/// one, > 0).
pub fn keep(
    scored: &ScoredData,
    keep_equal_scores: bool,
    max_token_len: i64,
) -> Result<(), Dropped> {
    if scored.scores.iter().any(|score| score.is_nan()) {
        return Err(Dropped::Failed);
    }
    let first = scored.scores.first().copied().unwrap_or_default();
    if !keep_equal_scores && scored.scores.iter().all(|&score| score == first) {
        return Err(Dropped::EqualScores);
    }
    if max_token_len > 0 {
        if let Some(long) = scored
            .tokens
            .iter()
            .map(Vec::len)
            .find(|&length| length as i64 >= max_token_len)
        {
            return Err(Dropped::TooLong(long));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use holo_core::loom::{ContextRecord, Failure, MessageRecord, PartRecord, Stage, TokensRecord};
    use holo_core::Role;
    use std::collections::BTreeMap;

    fn status(
        queue_size: i64,
        self_queue_size: i64,
        max_group_size: i64,
        unallocated: f64,
    ) -> EnvStatus {
        EnvStatus {
            current_step: 0,
            queue_size,
            self_queue_size,
            max_group_size,
            env_weight: 1.0,
            unallocated_fraction: unallocated,
        }
    }

    #[test]
    fn the_throttle_follows_base_env() {
        // Group size 2, batches of 8, 3 batches off-policy: room for 12 groups.
        let plain = EnvOptions {
            group_size: 2,
            max_workers: 8,
            ..EnvOptions::default()
        };
        assert_eq!(
            throttle(&status(0, 0, 1, 1.0), &plain, 8, 10),
            Throttle::RollOut(8)
        );
        assert_eq!(
            throttle(&status(9, 9, 2, 1.0), &plain, 8, 10),
            Throttle::RollOut(3)
        );
        assert_eq!(
            throttle(&status(12, 12, 2, 1.0), &plain, 8, 10),
            Throttle::Wait
        );
        // 3 steps done and 64 sequences queued: 8 more steps, past 10.
        let mut done = status(32, 32, 2, 1.0);
        done.current_step = 3;
        assert_eq!(throttle(&done, &plain, 8, 10), Throttle::Stop);
        // With a share of half of each batch, the queue full of another environment's groups of 4
        // (12 of this one's size), and none of its own: it goes on until it holds ⌈0.5 · 24 / 4⌉ = 3
        // packs of 4, 6 groups of its own, rolling out ((3 + 2) · 4 − 0) / 2 = 10 rows.
        let shared = EnvOptions {
            min_batch_allocation: Some(0.5),
            ..plain.clone()
        };
        assert_eq!(
            throttle(&status(12, 0, 4, 0.5), &plain, 8, 10),
            Throttle::Wait
        );
        assert_eq!(
            throttle(&status(12, 0, 4, 0.5), &shared, 8, 10),
            Throttle::RollOut(10)
        );
        assert_eq!(
            throttle(&status(18, 6, 4, 0.5), &shared, 8, 10),
            Throttle::Wait
        );
    }

    fn record(rollout: usize, reward: f64, contexts: Vec<ContextRecord>) -> RolloutRecord {
        RolloutRecord {
            dataset: None,
            row_index: 0,
            rollout_index: rollout,
            seed: 0,
            row: Default::default(),
            contexts,
            rewards: BTreeMap::from([("r".to_string(), reward)]),
            weights: BTreeMap::from([("r".to_string(), 1.0)]),
            feedback: BTreeMap::new(),
            reward,
            samples: 2,
            truncated: false,
            step: None,
            error: None,
            timing: None,
        }
    }

    /// A two-turn context: prompt 10 11, sampled 12 13, a tool result 14, sampled 15.
    fn context(logprobs: [f32; 3]) -> ContextRecord {
        let part = |text: &str, sampled| PartRecord {
            text: text.into(),
            sampled,
            weight_version: None,
        };
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
                    parts: vec![part("a", true), part("b", true)],
                    tool: None,
                },
            ],
            tokens: Some(TokensRecord {
                ids: vec![10, 11, 12, 13, 14, 15],
                loss_mask: vec![0, 0, 1, 1, 0, 1],
                logprobs: vec![0.0, 0.0, logprobs[0], logprobs[1], 0.0, logprobs[2]],
                retokenized: false,
                routes: None,
                constraints: Vec::new(),
            }),
        }
    }

    #[test]
    fn a_multi_turn_rollout_is_one_sequence_masked_and_aligned() {
        let records = [
            record(0, 1.0, vec![context([-0.5, -0.25, -1.0])]),
            record(1, 0.0, vec![context([-0.1, -0.2, -0.3])]),
        ];
        let scored = scored_group(&records, 0.7).unwrap();
        assert_eq!(scored.tokens[0], vec![10, 11, 12, 13, 14, 15]);
        assert_eq!(scored.masks[0], vec![-100, -100, 12, 13, -100, 15]);
        assert_eq!(scored.scores, vec![1.0, 0.0]);
        assert_eq!(
            scored.inference_logprobs.as_ref().unwrap()[0],
            vec![1.0, 1.0, -0.5, -0.25, 1.0, -1.0]
        );
        let messages = scored.messages.as_ref().unwrap();
        assert_eq!(messages[0][1]["role"], "assistant");
        assert_eq!(messages[0][1]["content"], "ab");
        assert_eq!(
            scored.generation_params.as_ref().unwrap()["temperature"],
            0.7
        );
        assert_eq!(keep(&scored, false, 64), Ok(()));
        assert_eq!(keep(&scored, false, 6), Err(Dropped::TooLong(6)));
    }

    #[test]
    fn missing_logprobs_leave_the_field_out_and_equal_scores_drop_the_group() {
        let records = [
            record(0, 1.0, vec![context([-0.5, 0.0, -1.0])]),
            record(1, 1.0, vec![context([-0.1, -0.2, -0.3])]),
        ];
        let scored = scored_group(&records, 1.0).unwrap();
        assert_eq!(scored.inference_logprobs, None);
        assert_eq!(keep(&scored, false, 0), Err(Dropped::EqualScores));
        assert_eq!(keep(&scored, true, 0), Ok(()));
    }

    #[test]
    fn failed_rollouts_drop_the_group_and_several_contexts_are_refused() {
        let mut failed = record(1, 0.0, vec![]);
        failed.error = Some(Failure {
            stage: Stage::Sampler,
            message: "down".into(),
        });
        let scored =
            scored_group(&[record(0, 1.0, vec![context([-1.0; 3])]), failed], 1.0).unwrap();
        assert_eq!(keep(&scored, false, 0), Err(Dropped::Failed));
        let two = record(0, 1.0, vec![context([-1.0; 3]), context([-1.0; 3])]);
        let error = scored_group(&[two], 1.0).unwrap_err();
        assert!(error.contains("2 trained contexts"), "{error}");
    }
}
