//! The [`Loom`]: runs rollouts at scale. It drives `B` data rows × `G` rollouts each against one
//! [`Sampler`], sending each rollout's next request the moment it is ready, and hands each rollout's
//! record to a [`Sink`] the moment it finishes (kept, or written as a line of JSONL by [`Jsonl`]).
//!
//! ```no_run
//! use std::sync::Arc;
//! use holo_core::holotypes::{self, Tools};
//! use holo_core::interpreter::{Holoware, Row};
//! use holo_core::loom::{Jsonl, Loom, LoomConfig};
//! use holo_core::{Resources, Scripted};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let holoware = Arc::new(Holoware::open("hol/tool.hol".as_ref(), Arc::new(holotypes::registry()))?);
//! let mut resources = Resources::default();
//! resources.insert(Tools::new().with_calculator());
//! let loom = Loom::interpreted(holoware, resources, LoomConfig { rollouts_per_row: 8, ..LoomConfig::default() });
//! let row: Row = serde_json::from_str(r#"{"query": "What is 17 * 23?", "expected": "391"}"#)?;
//! let sampler = Scripted::new(["<answer>391</answer>"]);
//! let mut out = Jsonl(std::fs::File::create("rollouts.jsonl")?);
//! let summary = loom.run(&[(0, row)], &sampler, &mut out).await?;
//! println!("mean reward {:?}, pass@1 {:?}", summary.mean_reward, summary.pass_at_k);
//! # Ok(())
//! # }
//! ```
//!
//! # Rollouts
//!
//! The Loom drives anything that implements [`Rollout`], boxed as `Box<dyn Rollout + Send>`: a
//! [`RolloutSource`] starts one per (row, rollout). [`Interpreted`] starts interpreted holowares
//! ([`Holoware`] + [`Resources`]); a closure `Fn(&Row) -> Result<Box<dyn Rollout + Send>, String>` starts
//! anything else, such as a machine compiled with `include_holoware!`:
//!
//! ```ignore
//! let source = move |row: &Row| -> Result<Box<dyn Rollout + Send>, String> {
//!     let input = serde_json::from_value(serde_json::Value::Object(row.clone())).map_err(|e| e.to_string())?;
//!     Ok(Box::new(tool::Machine::with_resources(input, &resources).map_err(|e| e.to_string())?))
//! };
//! let loom = Loom::new(source, LoomConfig::default());
//! ```
//!
//! Before a row's first rollout starts, [`RolloutSource::check`] checks it ([`Holoware::check_row`] for
//! interpreted holowares): a row that lacks an input runs no rollout and is reported in
//! [`Summary::row_failures`]; every other row still runs.
//!
//! # Scheduling
//!
//! Rollouts are started in order (row by row, `G` rollouts of a row one after the other) and at most
//! [`LoomConfig::concurrency`] are in flight at once. A rollout is stepped until it needs a sample
//! ([`Step::Sample`]) or ends; its request goes to the sampler at once, as its own [`Sampler::sample`]
//! call, and when the completion comes back the rollout is resumed and stepped again, whatever the other
//! rollouts are doing. There are no ticks: a rollout with short turns does not wait for the longest
//! sample of the others. The sampler decides how to batch: the local model schedules every call in one
//! continuously batched engine (`holo_model::schedule`), an OpenAI-compatible server receives
//! concurrent requests. When a rollout ends, the next one starts.
//!
//! A failed request ([`SamplerError`]), a [`RolloutError`](crate::RolloutError), a panic in a holotype,
//! or a rollout that cannot start fails that rollout only: it is written with its `error` and what it
//! recorded up to then, and the others go on. Stepping runs holotypes synchronously: in place, while the
//! other rollouts' requests are in flight, or, when a holotype may block
//! ([`Holotype::BLOCKS`](crate::Holotype::BLOCKS): code in the sandbox), on Tokio's blocking pool, so
//! that such rollouts run beside each other and the samples of the others keep going (at most
//! `concurrency` threads).
//!
//! # Prompts
//!
//! **In token space**, with [`Loom::with_holophore`]: each rollout records into a fork of the
//! [`Holophore`] (the model's tokenizer and chat template) besides its [`Transcript`], and a request's
//! prompt is [`Prompt::Tokens`]: [`Holophore::prompt_ids`], the ids of the context being sampled with the
//! chat template's frames, injected text tokenized once, and earlier completions' tokens appended verbatim
//! (never re-tokenized), followed by the generation prompt when the sample starts a fresh assistant
//! message. What the model saw is exactly what the record's `tokens` hold. A sampler that answers with
//! text only (no [`Completion::tokens`]) has its text tokenized by the holophore, flagged `retokenized`.
//!
//! **As chat text**, without a holophore: each rollout records into its own [`Transcript`] and a request's
//! prompt is [`Prompt::Chat`] built from it: the messages of the context being sampled (the last context
//! begun), each message's parts joined as text, sampled parts included verbatim. When the assistant
//! message in progress already has content (a prefill, a fence's `<think>`, an earlier sample of the same
//! message) it is the last message, to be continued; when the sample starts a fresh assistant message, the
//! chat ends with the message before it and the server's generation prompt opens the assistant turn. This
//! path re-tokenizes on the server, so what the model saw is only as exact as the server's chat template.
//! One case the text view cannot say: a fresh assistant message that follows a finished assistant message
//! directly (no message between) is sent as a continuation of the finished one.
//!
//! # Parameters and seeds
//!
//! Each request's [`SampleParams`] come from its [`SampleRequest`] (`max_tokens`, `temperature`, `top_p`,
//! `top_k`, `stop`) plus a seed. A rollout's seed is derived from [`LoomConfig::seed`], the row index and
//! the rollout index (splitmix64 mixing, 63 bits so that it fits a signed 64-bit integer on every server);
//! the `k`-th request of the rollout (0-based) is sent with `mix(rollout seed, k)`, so each turn draws
//! fresh noise and a rerun with the same seed sends the same seeds. The rollout seed is written in the
//! JSONL.
//!
//! # JSONL
//!
//! One [`RolloutRecord`] per line, written and flushed as each rollout finishes (a crash loses nothing
//! done), in finishing order:
//!
//! ```json
//! {"dataset": "rows.jsonl", "row_index": 0, "rollout_index": 1, "seed": 8214...,
//!  "row": {"query": "What is 17 * 23?", "expected": "391"},
//!  "contexts": [{"trained": true, "messages": [
//!     {"role": "system", "parts": [{"text": "You have access ...", "sampled": false}]},
//!     {"role": "assistant", "parts": [{"text": "<answer>391</answer>", "sampled": true}]}]}],
//!  "rewards": {"math_answer": 1.0}, "weights": {"math_answer": 1.0}, "reward": 1.0,
//!  "samples": 2, "error": null,
//!  "timing": {"start_ms": 0.4, "wall_ms": 1.9, "sample_ms": 1.2}}
//! ```
//!
//! With a holophore, each context also has `"tokens": {"ids": [...], "loss_mask": [...], "logprobs":
//! [...]}` ([`TokensRecord`]; `"retokenized": true` added when some completion came as text only): the
//! context's token ids with the chat template's frames, 1 in the mask exactly on the sampled tokens of a
//! trained context (all 0 in an untrained one), and the sampler's logprob of each sampled token (0
//! elsewhere). The ids end with the template's footer of the last message. A rollout whose text the
//! tokenizer could not encode, or whose conversation the chat template refused (it raised), fails with stage
//! `rollout`, since its tokens are incomplete. A context whose template rewrites what the model saw at a later
//! turn (Qwen3 drops earlier turns' `<think>` blocks) is recorded as several contexts, one per rewrite, each
//! with its own tokens and the messages it holds (earlier completions as prompt text); see
//! [`crate::holophore`].
//!
//! `dataset` is there when [`LoomConfig::dataset`] is set. `rewards` holds each component's value (the
//! sum, when a component is recorded more than once), `weights` its weight, `reward` the weighted total of
//! every recorded component. `error` is `null` or `{"stage": "start" | "rollout" | "sampler", "message":
//! ...}`. `timing` (left out when [`LoomConfig::timing`] is off, for identical records in reruns; lines come in finishing order, which depends on the sampler's timing): when the
//! rollout started after the run began, its wall time, and the part of it spent waiting for its samples.
//!
//! # Truncation
//!
//! A rollout is `truncated` when one of its samples ended for length ([`Finish::Length`]). It goes on as
//! the holoware says (its reward holotypes still run). A completion with no token and no text that
//! ended for length means the prompt already fills the model's context: the rollout ends there, written
//! as truncated (not failed) with what it recorded.
//!
//! # Summary and pass@k
//!
//! [`Summary`] has the mean of each reward component and of the total over the rollouts that completed
//! (a failed rollout is counted in [`Summary::failed`], not in the means), and pass@k for k = 1 and, when
//! `G > 1`, k = `G`. A rollout **passes** when it completed with full credit (≥ 1) on the correctness
//! component: [`LoomConfig::pass_component`], else the source's ([`RolloutSource::pass_component`]: an
//! interpreted holoware's answer check, `ExactAnswer` or `MathAnswer`, the one marked `pass=true` where
//! there are several). Never the total reward, which a format bonus raises for a wrong answer and a length
//! penalty lowers for a right one. pass@k is the unbiased estimator `1 - C(n-c, k) / C(n, k)` per row (`n`
//! rollouts, `c` passing), averaged over the rows that ran; without a correctness component it is not
//! computed ([`Summary::pass_at_k`] is empty).
//!
//! # Progress
//!
//! With [`LoomConfig::progress`], an indicatif bar on stderr shows rollouts done, rollouts/s and the mean
//! reward; it is drawn only when stderr is a terminal.

use std::collections::BTreeMap;
use std::io::{self, IsTerminal};
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::holophore::Holophore;
use crate::holotypes::{ReflectionMemory, ToolStats};
use crate::interpreter::{Holoware, Row};
use crate::machine::{Completion, Finish, Recorder, Rollout, SampleRequest, Step, TemplateArg};
use crate::resources::Resources;
use crate::sampler::{
    ChatMessage, Constraint, Prompt, Request, SampleParams, Sampler, SamplerError,
};
use crate::tools::{ToolFormat, ToolReply};
use crate::transcript::{Part, Transcript};
use crate::Role;

mod record;
mod sink;
mod summary;

pub use crate::constraint::Constrained;
pub use record::{
    ContextRecord, Failure, MessageRecord, PartRecord, RolloutFailure, RolloutRecord, RowFailure,
    Stage, Timing, TokensRecord, ToolCallRecord, ToolRecord,
};
pub use sink::{Jsonl, Sink};
use summary::Stats;
pub use summary::{pass_at_k, passes, ComponentMean, Summary};

/// Starts the rollouts the Loom drives.
pub trait RolloutSource: Sync {
    /// Checks a row before its first rollout; an `Err` (a message naming what is missing) skips the row.
    fn check(&self, row: &Row) -> Result<(), String> {
        let _ = row;
        Ok(())
    }

    /// Starts one rollout on a row.
    fn start(&self, row: &Row) -> Result<Box<dyn Rollout + Send>, String>;

    /// Whether stepping a rollout may hold the thread for long ([`Holotype::BLOCKS`](crate::Holotype::BLOCKS)):
    /// the Loom then steps rollouts on Tokio's blocking pool. The default says no.
    fn blocks(&self) -> bool {
        false
    }

    /// The reward component whose full credit (≥ 1) makes a rollout pass, for pass@k
    /// ([`Holoware::pass_component`] for interpreted holowares); [`LoomConfig::pass_component`] overrides
    /// it. The default: none, and pass@k is not computed.
    fn pass_component(&self) -> Option<&str> {
        None
    }

    /// The counters of tool runs the rollouts share, when there are any (a trainer logs them).
    fn tool_stats(&self) -> Option<Arc<ToolStats>> {
        None
    }

    /// ERL's reflection memory the rollouts share, when they have one: a trainer sizes it, commits what
    /// each generation remembered, and keeps it in its checkpoints.
    fn reflection_memory(&self) -> Option<Arc<ReflectionMemory>> {
        None
    }
}

/// Any `Fn(&Row) -> Result<Box<dyn Rollout + Send>, String>`: rows are not checked beforehand.
impl<F> RolloutSource for F
where
    F: Fn(&Row) -> Result<Box<dyn Rollout + Send>, String> + Sync,
{
    fn start(&self, row: &Row) -> Result<Box<dyn Rollout + Send>, String> {
        self(row)
    }
}

/// Interpreted rollouts of a holoware, each with the same resources.
pub struct Interpreted {
    pub holoware: Arc<Holoware>,
    pub resources: Resources,
}

impl RolloutSource for Interpreted {
    fn check(&self, row: &Row) -> Result<(), String> {
        self.holoware
            .check_row(row)
            .map_err(|missing| missing.to_string())?;
        self.holoware.row_constraints(row).map(drop)
    }

    fn tool_stats(&self) -> Option<Arc<ToolStats>> {
        self.resources.get::<ToolStats>()
    }

    fn reflection_memory(&self) -> Option<Arc<ReflectionMemory>> {
        self.resources.get::<ReflectionMemory>()
    }

    fn blocks(&self) -> bool {
        self.holoware.blocks()
    }

    fn pass_component(&self) -> Option<&str> {
        self.holoware.pass_component()
    }

    fn start(&self, row: &Row) -> Result<Box<dyn Rollout + Send>, String> {
        match self.holoware.start_with(row, &self.resources) {
            Ok(rollout) => Ok(Box::new(rollout)),
            Err(error) => Err(error.to_string()),
        }
    }
}

/// How a [`Loom`] runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoomConfig {
    /// `G`: rollouts per data row (at least 1).
    pub rollouts_per_row: usize,
    /// The run seed every rollout's seed is derived from.
    pub seed: u64,
    /// Rollouts in flight at once, so the most requests in flight (at least 1; default 128).
    pub concurrency: usize,
    /// Draw a progress bar on stderr when it is a terminal (default off).
    pub progress: bool,
    /// Write each rollout's `timing` (default on; off makes reruns write identical records).
    pub timing: bool,
    /// Written as `dataset` in every record when set.
    pub dataset: Option<String>,
    /// The reward component pass@k counts, when set; else the source's
    /// ([`RolloutSource::pass_component`]: an interpreted holoware's answer check).
    pub pass_component: Option<String>,
}

impl LoomConfig {
    /// Why `record`, read back from an earlier run, is not one this run would make (another rollout
    /// count or run seed), or `None`.
    pub fn foreign(&self, record: &RolloutRecord) -> Option<String> {
        let (row, rollout) = (record.row_index, record.rollout_index);
        let per_row = self.rollouts_per_row.max(1);
        if rollout >= per_row {
            Some(format!("this run makes {per_row} rollouts per row"))
        } else if record.seed != rollout_seed(self.seed, row, rollout) {
            Some("it was made with another run seed".into())
        } else {
            None
        }
    }
}

impl Default for LoomConfig {
    fn default() -> Self {
        LoomConfig {
            rollouts_per_row: 1,
            seed: 0,
            concurrency: 128,
            progress: false,
            timing: true,
            dataset: None,
            pass_component: None,
        }
    }
}

/// Drives rollouts from a [`RolloutSource`]; see the [module documentation](self).
pub struct Loom<S> {
    source: S,
    config: LoomConfig,
    holophore: Option<Holophore>,
}

impl Loom<Interpreted> {
    /// A Loom over interpreted rollouts of `holoware`.
    pub fn interpreted(holoware: Arc<Holoware>, resources: Resources, config: LoomConfig) -> Self {
        Loom::new(
            Interpreted {
                holoware,
                resources,
            },
            config,
        )
    }
}

impl<S: RolloutSource> Loom<S> {
    pub fn new(source: S, config: LoomConfig) -> Self {
        Loom {
            source,
            config,
            holophore: None,
        }
    }

    /// Records every rollout in token space with a fork of `holophore` (a model's tokenizer and chat
    /// template) and sends [`Prompt::Tokens`]; see "Prompts" in the [module documentation](self).
    pub fn with_holophore(mut self, holophore: Holophore) -> Self {
        self.holophore = Some(holophore);
        self
    }

    pub fn config(&self) -> &LoomConfig {
        &self.config
    }

    /// Runs `G` rollouts of every row (`(row index, row)`; the index is written in the records and seeds
    /// the rollouts) through `sampler`, handing each finished rollout's record to `out` ([`Sink`]: keep
    /// them in a `Vec`, write them as JSONL with [`Jsonl`]). Fails only when the sink fails; everything
    /// done before is already in it.
    pub async fn run<W, P>(
        &self,
        rows: &[(usize, Row)],
        sampler: &P,
        out: &mut W,
    ) -> io::Result<Summary>
    where
        W: Sink + Send + ?Sized,
        P: Sampler + ?Sized,
    {
        self.resume(rows, &[], sampler, out).await
    }

    /// [`Loom::run`] after an interrupted run: `done` are the completed records of these rows read back
    /// from its JSONL. Their rollouts are not run again (nor written again) but count in the summary;
    /// every other rollout runs with the seed it would have had. Records of rows not in `rows`, records
    /// made with another run seed, and failed records are refused (`InvalidInput`): a failed rollout is
    /// run again by leaving its record out.
    pub async fn resume<W, P>(
        &self,
        rows: &[(usize, Row)],
        done: &[RolloutRecord],
        sampler: &P,
        out: &mut W,
    ) -> io::Result<Summary>
    where
        W: Sink + Send + ?Sized,
        P: Sampler + ?Sized,
    {
        let per_row = self.config.rollouts_per_row.max(1);
        let positions: BTreeMap<usize, usize> = rows
            .iter()
            .enumerate()
            .map(|(position, (row_index, _))| (*row_index, position))
            .collect();
        let pass_component = self
            .config
            .pass_component
            .as_deref()
            .or(self.source.pass_component());
        let mut stats = Stats::new(rows.len(), pass_component);
        let mut skip = std::collections::BTreeSet::new();
        for record in done {
            let (row_index, rollout_index) = (record.row_index, record.rollout_index);
            let invalid = |why: String| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("record of row {row_index}, rollout {rollout_index}: {why}"),
                )
            };
            let Some(&position) = positions.get(&row_index) else {
                return Err(invalid("the data has no such row".into()));
            };
            if let Some(why) = self.config.foreign(record) {
                return Err(invalid(why));
            }
            if record.error.is_some() {
                return Err(invalid("it failed; leave it out to run it again".into()));
            }
            if !skip.insert((row_index, rollout_index)) {
                return Err(invalid("it appears twice".into()));
            }
            stats.add(position, record);
        }
        let concurrency = self.config.concurrency.max(1);
        let progress = if self.config.progress && io::stderr().is_terminal() {
            progress_bar((rows.len() * per_row - done.len()) as u64)
        } else {
            ProgressBar::hidden()
        };
        let mut run = Run {
            config: &self.config,
            rows,
            out,
            started: Instant::now(),
            stats,
            progress,
        };
        let mut jobs = Jobs {
            rows,
            per_row,
            position: 0,
            next_rollout: 0,
            skip,
        };

        // Each request is its own sampler call, so that a rollout goes on the moment its sample is
        // back, whatever the others are doing: the local model batches the calls continuously.
        let sample = |active: Active, request: Request| -> Pending<'_> {
            Box::pin(async move {
                let sent = Instant::now();
                let mut results = sampler.sample(std::slice::from_ref(&request)).await;
                let result = match results.len() {
                    1 => results.pop().expect("one result"),
                    n => Err(SamplerError::Malformed(format!(
                        "the sampler returned {n} results for one request"
                    ))),
                };
                Ok(Event::Sampled(active, result, sent.elapsed()))
            })
        };
        let blocks = self.source.blocks();
        let mut in_flight: FuturesUnordered<Pending<'_>> = FuturesUnordered::new();
        loop {
            while in_flight.len() < concurrency {
                let Some((position, rollout_index)) = jobs.next(&self.source, &mut run.stats)
                else {
                    break;
                };
                let (row_index, row) = &rows[position];
                let mut active = Active {
                    position,
                    row_index: *row_index,
                    rollout_index,
                    seed: rollout_seed(self.config.seed, *row_index, rollout_index),
                    rollout: None,
                    recorder: Prompted {
                        holophore: self.holophore.as_ref().map(Holophore::fork),
                        ..Prompted::default()
                    },
                    samples: 0,
                    truncated: false,
                    started: Instant::now(),
                    sample_time: Duration::ZERO,
                    constraint: None,
                    location: "",
                };
                match guard(|| self.source.start(row)) {
                    Ok(rollout) => {
                        active.rollout = Some(rollout);
                        step(&mut run, &mut in_flight, &sample, blocks, active, None)?;
                    }
                    Err(message) => run.finish(
                        active,
                        Some(Failure {
                            stage: Stage::Start,
                            message,
                        }),
                    )?,
                }
            }
            let Some(event) = in_flight.next().await else {
                break;
            };
            match event? {
                Event::Sampled(mut active, result, waited) => {
                    run.stats.sampler_calls += 1;
                    active.sample_time += waited;
                    match result {
                        Ok(completion) if context_full(&completion) => {
                            active.truncated = true;
                            run.finish(active, None)?;
                        }
                        Ok(completion) => step(
                            &mut run,
                            &mut in_flight,
                            &sample,
                            blocks,
                            active,
                            Some(completion),
                        )?,
                        Err(error) => {
                            // A constraint the sampler refuses is the tag's: say which.
                            let message = match (&active.constraint, active.location) {
                                (Some(_), location) => format!("{location}: {error}"),
                                (None, _) => error.to_string(),
                            };
                            run.finish(
                                active,
                                Some(Failure {
                                    stage: Stage::Sampler,
                                    message,
                                }),
                            )?
                        }
                    }
                }
                Event::Stepped(active, stepped) => {
                    stepped_to(&mut run, &mut in_flight, &sample, active, stepped)?
                }
            }
        }
        run.progress.finish_and_clear();
        Ok(run.stats.summary(per_row, run.started.elapsed()))
    }
}

/// What comes back to the Loom's loop: a rollout's sample, or its synchronous work done.
enum Event {
    Sampled(Active, Result<Completion, SamplerError>, Duration),
    Stepped(Active, Stepped),
}

/// Where a rollout's synchronous work (resuming with a completion, then stepping) left it.
enum Stepped {
    /// It needs this sample.
    Sample(SampleRequest),
    Done,
    /// A holotype's error or panic.
    Failed(String),
}

/// A rollout waiting on its sampler or its own work.
type Pending<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = io::Result<Event>> + Send + 'a>>;

/// [`work`] on the blocking pool of the Tokio runtime the Loom runs under, never on the thread that
/// drives the other rollouts' samples (at most `concurrency` rollouts are in flight, which bounds the
/// threads it takes); in place when there is no runtime (a caller's own executor).
fn offload(active: Active, completion: Option<Completion>) -> Pending<'static> {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => Box::pin(async move {
            match runtime
                .spawn_blocking(move || work(active, completion))
                .await
            {
                Ok((active, stepped)) => Ok(Event::Stepped(active, stepped)),
                Err(error) => Err(io::Error::other(format!(
                    "a rollout's step did not finish: {error}"
                ))),
            }
        }),
        Err(_) => {
            let (active, stepped) = work(active, completion);
            Box::pin(std::future::ready(Ok(Event::Stepped(active, stepped))))
        }
    }
}

/// Resumes and steps the rollout ([`work`]): on the blocking pool when its holotypes may block
/// ([`offload`], whose event comes back to the loop), else here and now, in an order as reproducible as
/// the sampler's.
fn step<'s, W: Sink + ?Sized>(
    run: &mut Run<'_, W>,
    in_flight: &mut FuturesUnordered<Pending<'s>>,
    sample: &impl Fn(Active, Request) -> Pending<'s>,
    blocks: bool,
    active: Active,
    completion: Option<Completion>,
) -> io::Result<()> {
    if blocks {
        in_flight.push(offload(active, completion));
        return Ok(());
    }
    let (active, stepped) = work(active, completion);
    stepped_to(run, in_flight, sample, active, stepped)
}

/// Sends the stepped rollout's request on its way, or writes the rollout when it ended.
fn stepped_to<'s, W: Sink + ?Sized>(
    run: &mut Run<'_, W>,
    in_flight: &mut FuturesUnordered<Pending<'s>>,
    sample: &impl Fn(Active, Request) -> Pending<'s>,
    mut active: Active,
    stepped: Stepped,
) -> io::Result<()> {
    match stepped {
        Stepped::Sample(sample_request) => {
            let request = active.request(sample_request);
            active.samples += 1;
            in_flight.push(sample(active, request));
            Ok(())
        }
        Stepped::Done => run.finish(active, None),
        Stepped::Failed(message) => run.finish(
            active,
            Some(Failure {
                stage: Stage::Rollout,
                message,
            }),
        ),
    }
}

/// Resumes the rollout with `completion` (when it has one) and steps it until it needs a sample or
/// ends: the holotypes' synchronous work, on whatever thread runs it.
fn work(mut active: Active, completion: Option<Completion>) -> (Active, Stepped) {
    let rollout = active.rollout.as_mut().expect("a started rollout");
    if let Some(mut completion) = completion {
        active.truncated |= completion.finish == Finish::Length;
        completion.constraint = active.constraint.take();
        if let Err(message) = guard(|| rollout.resume(completion, &mut active.recorder)) {
            return (active, Stepped::Failed(message));
        }
    }
    let stepped = match guard(|| rollout.step(&mut active.recorder)) {
        Ok(Step::Sample(sample)) => Stepped::Sample(sample),
        Ok(Step::Done) => Stepped::Done,
        Err(message) => Stepped::Failed(message),
    };
    (active, stepped)
}

/// A completion that ended for length without a token: the prompt already fills the model's context, so
/// the rollout cannot go on.
fn context_full(completion: &Completion) -> bool {
    completion.finish == Finish::Length
        && completion.tokens.is_empty()
        && completion.text.is_empty()
}

/// Starts the rows' rollouts in order, checking each row before its first.
struct Jobs<'r> {
    rows: &'r [(usize, Row)],
    per_row: usize,
    position: usize,
    next_rollout: usize,
    /// `(row index, rollout index)` already done in an earlier run.
    skip: std::collections::BTreeSet<(usize, usize)>,
}

impl Jobs<'_> {
    fn next(&mut self, source: &impl RolloutSource, stats: &mut Stats) -> Option<(usize, usize)> {
        loop {
            let (row_index, row) = self.rows.get(self.position)?;
            if self.next_rollout == 0 {
                if let Err(message) = guard(|| source.check(row)) {
                    stats.row_failures.push(RowFailure {
                        row_index: *row_index,
                        message,
                    });
                    self.position += 1;
                    continue;
                }
                stats.rows_ran += 1;
            }
            let job = (self.position, self.next_rollout);
            self.next_rollout += 1;
            if self.next_rollout == self.per_row {
                self.next_rollout = 0;
                self.position += 1;
            }
            if self.skip.contains(&(*row_index, job.1)) {
                continue;
            }
            return Some(job);
        }
    }
}

/// A rollout in flight. It owns everything it needs, so that its synchronous steps can run on another
/// thread.
struct Active {
    /// Position of its row in the rows given to `run`.
    position: usize,
    row_index: usize,
    rollout_index: usize,
    seed: u64,
    /// `None` only when the rollout could not start.
    rollout: Option<Box<dyn Rollout + Send>>,
    recorder: Prompted,
    samples: u32,
    truncated: bool,
    started: Instant,
    sample_time: Duration,
    /// The constraint of the request in flight, which its completion is recorded with, and its
    /// sampler tag's `file.hol:line:col`.
    constraint: Option<Constraint>,
    location: &'static str,
}

impl Active {
    /// The request for the rollout's next sample.
    fn request(&mut self, sample: SampleRequest) -> Request {
        self.constraint = sample.constraint.clone();
        self.location = sample.location;
        Request {
            prompt: self.recorder.prompt(),
            params: SampleParams {
                max_tokens: sample.max_tokens,
                temperature: sample.temperature,
                top_p: sample.top_p,
                top_k: sample.top_k,
                stop: sample.stop,
                constraint: sample.constraint,
                seed: Some(request_seed(self.seed, self.samples)),
                top_logprobs: 0,
                chat_template_kwargs: self.recorder.template_kwargs.clone(),
                ..SampleParams::default()
            },
        }
    }
}

struct Run<'a, W: ?Sized> {
    config: &'a LoomConfig,
    rows: &'a [(usize, Row)],
    out: &'a mut W,
    started: Instant,
    stats: Stats,
    progress: ProgressBar,
}

impl<W: Sink + ?Sized> Run<'_, W> {
    /// Writes the finished rollout and counts it.
    fn finish(&mut self, mut active: Active, mut error: Option<Failure>) -> io::Result<()> {
        let now = Instant::now();
        let tokens = active.recorder.tokens();
        if let Some(holophore) = &active.recorder.holophore {
            if error.is_none() && !holophore.errors().is_empty() {
                error = Some(Failure {
                    stage: Stage::Rollout,
                    message: format!(
                        "the tokens are incomplete: {}",
                        holophore.errors().join("; ")
                    ),
                });
            }
        }
        let transcript = &active.recorder.transcript;
        let mut rewards = BTreeMap::new();
        let mut weights = BTreeMap::new();
        for (name, value, weight) in &transcript.rewards {
            rewards.insert(name.clone(), *value);
            weights.insert(name.clone(), *weight);
        }
        let feedback = transcript.feedback.iter().cloned().collect();
        let reward = transcript.reward();
        let record = RolloutRecord {
            dataset: self.config.dataset.clone(),
            row_index: active.row_index,
            rollout_index: active.rollout_index,
            seed: active.seed,
            row: self.rows[active.position].1.clone(),
            contexts: context_records(transcript, tokens),
            rewards,
            weights,
            feedback,
            reward,
            samples: active.samples,
            truncated: active.truncated,
            step: None,
            error,
            timing: self.config.timing.then(|| Timing {
                start_ms: millis(active.started.duration_since(self.started)),
                wall_ms: millis(now.duration_since(active.started)),
                sample_ms: millis(active.sample_time),
            }),
        };
        self.stats.add(active.position, &record);
        self.out.put(record)?;
        self.progress.inc(1);
        if let Some(mean) = self.stats.mean_reward() {
            self.progress.set_message(format!("mean reward {mean:.3}"));
        }
        Ok(())
    }
}

/// A [`Recorder`] that keeps a [`Transcript`] (and a [`Holophore`] when the Loom has one) and knows
/// whether an assistant message was begun but has no content yet (the transcript creates a message on
/// its first content).
/// A context of the holophore: the tokens of (a split of) one transcript context.
struct Piece {
    source: usize,
    completions: std::ops::Range<usize>,
    tokens: TokensRecord,
}

/// The records of a rollout's contexts: one per transcript context, or, with a holophore, one per context
/// it recorded. A transcript context the holophore split (a re-rendered template rewrote what the model
/// saw, see [`crate::holophore`]) gives one record per split: each with the messages up to its last
/// completion (the last split: all of them), and the completions before its own as prompt text.
fn context_records(transcript: &Transcript, pieces: Vec<Piece>) -> Vec<ContextRecord> {
    let message = |message: &crate::transcript::Message,
                   sampled: &mut usize,
                   completions: &std::ops::Range<usize>,
                   last: bool| {
        let mut parts = Vec::new();
        for part in &message.parts {
            if !last && *sampled >= completions.end {
                break;
            }
            match part {
                Part::Prompt(text) => parts.push(PartRecord {
                    text: text.clone(),
                    sampled: false,
                    weight_version: None,
                }),
                Part::Sampled(text, weight_version) => {
                    let ours = *sampled >= completions.start;
                    parts.push(PartRecord {
                        text: text.clone(),
                        sampled: ours,
                        weight_version: weight_version.filter(|_| ours),
                    });
                    *sampled += 1;
                }
            }
        }
        MessageRecord {
            role: message.role,
            parts,
            tool: message.tool.as_ref().map(ToolRecord::from),
        }
    };
    let whole = |context: &crate::transcript::Context, tokens: Option<TokensRecord>| {
        let mut sampled = 0;
        ContextRecord {
            trained: context.trained,
            tokens,
            tools: context.tools.clone(),
            messages: context
                .messages
                .iter()
                .map(|m| message(m, &mut sampled, &(0..usize::MAX), true))
                .collect(),
        }
    };
    let one_each = pieces.len() == transcript.contexts.len()
        && pieces
            .iter()
            .enumerate()
            .all(|(i, piece)| piece.source == i);
    let covered = pieces
        .iter()
        .all(|piece| piece.source < transcript.contexts.len())
        && (0..transcript.contexts.len()).all(|i| pieces.iter().any(|piece| piece.source == i));
    if pieces.is_empty() || one_each || !covered {
        return transcript
            .contexts
            .iter()
            .zip(
                pieces
                    .into_iter()
                    .map(|piece| Some(piece.tokens))
                    .chain(std::iter::repeat(None)),
            )
            .map(|(context, tokens)| whole(context, tokens))
            .collect();
    }
    let lasts: Vec<bool> = (0..pieces.len())
        .map(|i| {
            pieces
                .get(i + 1)
                .is_none_or(|next| next.source != pieces[i].source)
        })
        .collect();
    pieces
        .into_iter()
        .zip(lasts)
        .map(|(piece, last)| {
            let context = &transcript.contexts[piece.source];
            let mut sampled = 0;
            let mut messages = Vec::new();
            for m in &context.messages {
                if !last && sampled >= piece.completions.end {
                    break;
                }
                messages.push(message(m, &mut sampled, &piece.completions, last));
            }
            ContextRecord {
                trained: context.trained,
                tokens: Some(piece.tokens),
                tools: context.tools.clone(),
                messages,
            }
        })
        .collect()
}

#[derive(Default)]
struct Prompted {
    transcript: Transcript,
    pending: Option<Role>,
    holophore: Option<Holophore>,
    /// Without a holophore: the current context's own template arguments, which its chat requests
    /// carry for the sampler to render with.
    template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

impl Prompted {
    /// The prompt of the next sample: the holophore's token prompt, else the chat.
    fn prompt(&mut self) -> Prompt {
        match &mut self.holophore {
            Some(holophore) => Prompt::Tokens(holophore.prompt_ids()),
            None => Prompt::Chat(self.chat()),
        }
    }

    /// Closes the holophore's contexts and exports them (empty without a holophore), each with the
    /// transcript context it records and the completions of that context it holds.
    fn tokens(&mut self) -> Vec<Piece> {
        let Some(holophore) = &mut self.holophore else {
            return Vec::new();
        };
        holophore
            .finish()
            .iter()
            .map(|context| Piece {
                source: context.source,
                completions: context.completions.clone(),
                tokens: TokensRecord {
                    ids: context.ids(),
                    loss_mask: context.loss_mask(),
                    logprobs: context.logprobs(),
                    retokenized: context.retokenized(),
                    routes: context.routes(),
                    constraints: context.constraints.clone(),
                },
            })
            .collect()
    }

    /// The chat to sample from; see "Prompts" in the [module documentation](self).
    fn chat(&self) -> Vec<ChatMessage> {
        let Some(context) = self.transcript.contexts.last() else {
            return Vec::new();
        };
        context
            .messages
            .iter()
            .map(|message| ChatMessage {
                role: message.role,
                content: message
                    .parts
                    .iter()
                    .map(|part| match part {
                        Part::Prompt(text) | Part::Sampled(text, _) => text.as_str(),
                    })
                    .collect(),
            })
            .collect()
    }
}

impl Recorder for Prompted {
    fn begin_context(&mut self, trained: bool) {
        self.pending = None;
        self.template_kwargs = None;
        self.transcript.begin_context(trained);
        if let Some(holophore) = &mut self.holophore {
            holophore.begin_context(trained);
        }
    }

    /// A context's own template arguments: the holophore renders with them, or, for a sampler of
    /// chat messages, each request of the context carries them (`chat_template_kwargs`).
    fn template_arguments(&mut self, arguments: &[(&str, TemplateArg<'_>)]) -> Result<(), String> {
        if let Some(holophore) = &mut self.holophore {
            return holophore.template_arguments(arguments);
        }
        let kwargs = arguments
            .iter()
            .map(|&(name, argument)| (name.to_string(), argument.json()))
            .collect();
        self.template_kwargs = Some(kwargs);
        Ok(())
    }

    fn begin_message(&mut self, role: Role) {
        self.pending = Some(role);
        self.transcript.begin_message(role);
        if let Some(holophore) = &mut self.holophore {
            holophore.begin_message(role);
        }
    }

    fn text(&mut self, text: &str) {
        if !text.is_empty() {
            self.pending = None;
        }
        self.transcript.text(text);
        if let Some(holophore) = &mut self.holophore {
            holophore.text(text);
        }
    }

    fn completion(&mut self, completion: &Completion) {
        self.pending = None;
        self.transcript.completion(completion);
        if let Some(holophore) = &mut self.holophore {
            holophore.completion(completion);
        }
    }

    /// Native tools need token prompts rendered by the chat template: a sampler that takes chat
    /// messages gets no `tools`.
    fn offer_tools(
        &mut self,
        tools: &[serde_json::Value],
        format: Option<ToolFormat>,
    ) -> Result<ToolFormat, String> {
        let Some(holophore) = &mut self.holophore else {
            return Err("native tool calls need the model's chat template and token prompts: this \
                 sampler takes chat messages, which carry no `tools`; use text tools (no `parser=`)"
                .into());
        };
        let format = holophore.offer_tools(tools, format)?;
        self.transcript.offer_tools(tools, Some(format))
    }

    fn tool_format(&self) -> Option<ToolFormat> {
        self.transcript.tool_format()
    }

    fn tool_calls(&mut self, reply: &ToolReply) {
        self.transcript.tool_calls(reply);
        if let Some(holophore) = &mut self.holophore {
            holophore.tool_calls(reply);
        }
    }

    fn tool_result(&mut self, name: &str, id: Option<&str>, content: &str) {
        self.pending = None;
        self.transcript.tool_result(name, id, content);
        if let Some(holophore) = &mut self.holophore {
            holophore.tool_result(name, id, content);
        }
    }

    fn written(&self, text: &str) -> Option<String> {
        self.holophore.as_ref()?.written(text)
    }

    fn reward(&mut self, name: &str, value: f64, weight: f64) {
        Recorder::reward(&mut self.transcript, name, value, weight);
        if let Some(holophore) = &mut self.holophore {
            holophore.reward(name, value, weight);
        }
    }

    fn feedback(&mut self, name: &str, text: &str) {
        Recorder::feedback(&mut self.transcript, name, text);
        if let Some(holophore) = &mut self.holophore {
            Recorder::feedback(holophore, name, text);
        }
    }

    fn recorded_reward(&self, name: &str) -> Option<f64> {
        self.transcript.recorded_reward(name)
    }

    fn recorded_feedback(&self, name: &str) -> Option<&str> {
        self.transcript.recorded_feedback(name)
    }
}

/// Runs `f`, turning a panic into an error message.
fn guard<T, E: ToString>(f: impl FnOnce() -> Result<T, E>) -> Result<T, String> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result.map_err(|error| error.to_string()),
        Err(payload) => Err(format!(
            "panicked: {}",
            crate::error::panic_message(payload.as_ref())
        )),
    }
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

fn progress_bar(total: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{elapsed_precise} [{bar:30}] {pos}/{len} rollouts, {rate} rollouts/s, {msg}",
    ) {
        bar.set_style(
            style
                .with_key(
                    "rate",
                    |state: &indicatif::ProgressState, out: &mut dyn std::fmt::Write| {
                        let _ = write!(out, "{:.0}", state.per_sec());
                    },
                )
                .progress_chars("=> "),
        );
    }
    bar
}

/// The splitmix64 finalizer (seeds derived from seeds, here and in the trainer).
pub fn mix(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const SEED_MASK: u64 = i64::MAX as u64;

/// The seed of rollout `rollout_index` of row `row_index` in a run seeded with `seed` (63 bits).
pub fn rollout_seed(seed: u64, row_index: usize, rollout_index: usize) -> u64 {
    mix(mix(mix(seed) ^ row_index as u64) ^ rollout_index as u64) & SEED_MASK
}

/// The seed sent with the `k`-th request (0-based) of a rollout seeded with `rollout_seed` (63 bits).
pub fn request_seed(rollout_seed: u64, k: u32) -> u64 {
    mix(rollout_seed ^ mix(u64::from(k))) & SEED_MASK
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_at_k_estimator() {
        assert_eq!(pass_at_k(4, 0, 1), 0.0);
        assert_eq!(pass_at_k(4, 4, 1), 1.0);
        assert!((pass_at_k(4, 1, 1) - 0.25).abs() < 1e-12);
        assert_eq!(pass_at_k(4, 1, 4), 1.0);
        // 1 - C(3,2)/C(5,2) = 1 - 3/10
        assert!((pass_at_k(5, 2, 2) - 0.7).abs() < 1e-12);
        assert_eq!(pass_at_k(1, 1, 4), 1.0);
    }

    #[test]
    fn seeds_are_distinct_and_fit_i64() {
        let mut seen = std::collections::HashSet::new();
        for row in 0..50 {
            for rollout in 0..8 {
                let seed = rollout_seed(7, row, rollout);
                assert!(seed <= i64::MAX as u64);
                assert!(seen.insert(seed));
                assert!(seen.insert(request_seed(seed, 1)));
            }
        }
        assert_eq!(rollout_seed(7, 3, 2), rollout_seed(7, 3, 2));
        assert_ne!(rollout_seed(7, 3, 2), rollout_seed(8, 3, 2));
        assert_ne!(rollout_seed(7, 2, 3), rollout_seed(7, 3, 2));
    }

    #[test]
    fn the_chat_ends_with_the_assistant_message_only_when_it_has_content() {
        let mut recorder = Prompted::default();
        recorder.begin_context(true);
        recorder.begin_message(Role::User);
        recorder.text("hi");
        recorder.begin_message(Role::Assistant);
        let chat = recorder.chat();
        assert_eq!(chat.len(), 1);
        assert_eq!(chat[0].role, Role::User);
        recorder.text("<think>");
        let chat = recorder.chat();
        assert_eq!(chat.len(), 2);
        assert_eq!(chat[1].role, Role::Assistant);
        assert_eq!(chat[1].content, "<think>");
        recorder.completion(&Completion {
            text: "hmm</think>".into(),
            ..Completion::default()
        });
        recorder.text(" so");
        assert_eq!(recorder.chat()[1].content, "<think>hmm</think> so");
        // A new context starts a new chat.
        recorder.begin_context(false);
        recorder.begin_message(Role::Assistant);
        assert!(recorder.chat().is_empty());
    }
}
