//! The Loom with the scripted sampler over `hol/tool.hol` and the calculator on
//! `examples/data/arithmetic.jsonl`: batching, bounded concurrency, reproducibility, failures that stay
//! with their rollout, and JSONL written as rollouts finish.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use holo_core::holotypes::{self, Tools};
use holo_core::interpreter::{Holoware, Row};
use holo_core::loom::{
    request_seed, rollout_seed, Jsonl, Loom, LoomConfig, RolloutRecord, RolloutSource, Stage,
    Summary,
};
use holo_core::sampler::SampleFuture;
use holo_core::{
    Completion, Finish, Prompt, Recorder, Request, Resources, Role, Rollout, RolloutError,
    SampleRequest, Sampler, SamplerError, Scripted, Step,
};

const TOOL_CALL: &str = r#"<tool>{"name": "calculator", "args": {"expression": "17 * 23"}}</tool>"#;
const ANSWER: &str = "<answer>391</answer>";

fn repo() -> PathBuf {
    crate::common::repo()
}

fn tool_hol() -> Arc<Holoware> {
    Arc::new(
        Holoware::open(
            &repo().join("hol/tool.hol"),
            Arc::new(holotypes::registry()),
        )
        .unwrap(),
    )
}

fn calculator() -> Resources {
    let mut resources = Resources::default();
    resources.insert(Tools::new().with_calculator());
    resources
}

fn arithmetic() -> Vec<(usize, Row)> {
    let text = std::fs::read_to_string(repo().join("examples/data/arithmetic.jsonl")).unwrap();
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str(line).unwrap())
        .enumerate()
        .collect()
}

fn loom(config: LoomConfig) -> Loom<holo_core::loom::Interpreted> {
    Loom::interpreted(tool_hol(), calculator(), config)
}

fn script() -> Scripted {
    Scripted::new([TOOL_CALL, ANSWER])
}

fn records(bytes: &[u8]) -> Vec<RolloutRecord> {
    std::str::from_utf8(bytes)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// A writer whose bytes stay readable while the Loom holds it.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);

impl Shared {
    fn lines(&self) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
    }

    fn bytes(&self) -> Vec<u8> {
        self.0.lock().unwrap().clone()
    }
}

impl Write for Shared {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a [`Counting`] sampler saw at one call.
#[derive(Debug, Clone)]
struct Call {
    requests: Vec<Request>,
    /// Lines of JSONL already written when the batch was sent.
    lines_written: usize,
}

/// Wraps a sampler and records every batch.
struct Counting<S> {
    inner: S,
    calls: Mutex<Vec<Call>>,
    out: Shared,
}

impl<S> Counting<S> {
    fn new(inner: S, out: &Shared) -> Self {
        Counting {
            inner,
            calls: Mutex::new(Vec::new()),
            out: out.clone(),
        }
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn sizes(&self) -> Vec<usize> {
        self.calls()
            .iter()
            .map(|call| call.requests.len())
            .collect()
    }
}

impl<S: Sampler> Sampler for Counting<S> {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        self.calls.lock().unwrap().push(Call {
            requests: batch.to_vec(),
            lines_written: self.out.lines(),
        });
        self.inner.sample(batch)
    }
}

fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(future)
}

fn run<S: RolloutSource>(
    loom: &Loom<S>,
    rows: &[(usize, Row)],
    sampler: &(impl Sampler + ?Sized),
    out: &Shared,
) -> Summary {
    block_on(loom.run(rows, sampler, &mut Jsonl(out.clone()))).unwrap()
}

fn chat(request: &Request) -> &[holo_core::ChatMessage] {
    match &request.prompt {
        Prompt::Chat(messages) => messages,
        other => panic!("expected a chat prompt, got {other:?}"),
    }
}

#[test]
fn each_request_is_its_own_sampler_call_as_soon_as_it_is_ready() {
    let out = Shared::default();
    let sampler = Counting::new(script(), &out);
    let loom = loom(LoomConfig {
        rollouts_per_row: 4,
        timing: false,
        ..LoomConfig::default()
    });
    let summary = run(&loom, &arithmetic(), &sampler, &out);

    // 3 rows × 4 rollouts: every rollout calls the tool, then answers: 24 calls of one request. This
    // sampler answers at once: the 12 first requests go out in start order, then the second ones.
    assert_eq!(sampler.sizes(), [1; 24]);
    assert_eq!(summary.sampler_calls, 24);
    assert_eq!(summary.rollouts, 12);
    assert_eq!(summary.failed, 0);
    assert_eq!(summary.rows, 3);

    let calls = sampler.calls();
    // First requests: system + user; the fresh assistant message is opened by the server.
    for request in calls[..12].iter().flat_map(|call| &call.requests) {
        let messages = chat(request);
        assert_eq!(
            messages.iter().map(|m| m.role).collect::<Vec<_>>(),
            [Role::System, Role::User]
        );
        assert_eq!(request.params.stop, ["</tool>"]);
    }
    assert_eq!(chat(&calls[0].requests[0])[1].content, "What is 17 * 23?");
    assert_eq!(
        chat(&calls[4].requests[0])[1].content,
        "What is (1.5 + 2.5) / 4?"
    );
    // Second requests: the sampled tool call is in the prompt, then the tool's result.
    let second = chat(&calls[12].requests[0]);
    assert_eq!(second.len(), 4);
    assert_eq!(second[2].role, Role::Assistant);
    assert_eq!(second[2].content, TOOL_CALL);
    assert_eq!(second[3].role, Role::User);
    assert_eq!(second[3].content, "<result>391</result>");

    // Every reply answers 391: right for row 0 only.
    let records = records(&out.bytes());
    assert_eq!(records.len(), 12);
    for record in &records {
        assert_eq!(record.samples, 2);
        assert_eq!(record.error, None);
        let expected = if record.row_index == 0 { 1.0 } else { 0.0 };
        assert_eq!(record.rewards["math_answer"], expected);
        assert_eq!(record.weights["math_answer"], 1.0);
        assert_eq!(record.reward, expected);
        assert_eq!(
            record.row["query"],
            arithmetic()[record.row_index].1["query"]
        );
        let sampled: Vec<&str> = record.contexts[0]
            .messages
            .iter()
            .flat_map(|m| &m.parts)
            .filter(|p| p.sampled)
            .map(|p| p.text.as_str())
            .collect();
        assert_eq!(sampled, [TOOL_CALL, ANSWER]);
        assert!(record.contexts[0].trained);
    }
    assert_eq!(summary.components.len(), 1);
    assert_eq!(summary.components[0].name, "math_answer");
    assert!((summary.components[0].mean - 1.0 / 3.0).abs() < 1e-12);
    assert_eq!(summary.components[0].count, 12);
    assert!((summary.mean_reward.unwrap() - 1.0 / 3.0).abs() < 1e-12);
    assert_eq!(summary.pass_at_k.len(), 2);
    assert_eq!(summary.pass_at_k[0].0, 1);
    assert_eq!(summary.pass_at_k[1].0, 4);
    assert!((summary.pass_at_k[0].1 - 1.0 / 3.0).abs() < 1e-12);
    assert!((summary.pass_at_k[1].1 - 1.0 / 3.0).abs() < 1e-12);
}

#[test]
fn concurrency_bounds_rollouts_in_flight_and_lines_are_written_as_rollouts_finish() {
    let out = Shared::default();
    let sampler = Counting::new(script(), &out);
    let loom = loom(LoomConfig {
        rollouts_per_row: 4,
        concurrency: 5,
        ..LoomConfig::default()
    });
    let summary = run(&loom, &arithmetic(), &sampler, &out);
    // 12 rollouts, two samples each.
    assert_eq!(summary.sampler_calls, 24);
    // A rollout's first request (system + user) marks its start: at every call, at most five rollouts
    // have started and not been written, and five do at some point.
    let mut started = 0;
    let mut most = 0;
    for call in sampler.calls() {
        assert_eq!(call.requests.len(), 1);
        if chat(&call.requests[0]).len() == 2 {
            started += 1;
        }
        let in_flight = started - call.lines_written;
        assert!(in_flight <= 5, "{in_flight} rollouts in flight");
        most = most.max(in_flight);
    }
    assert_eq!((started, most), (12, 5));
    let records = records(&out.bytes());
    assert_eq!(records.len(), 12);
    // Written in finishing order: row by row, rollout by rollout here.
    let order: Vec<(usize, usize)> = records
        .iter()
        .map(|r| (r.row_index, r.rollout_index))
        .collect();
    let expected: Vec<(usize, usize)> = (0..3)
        .flat_map(|row| (0..4).map(move |k| (row, k)))
        .collect();
    assert_eq!(order, expected);
    for record in &records {
        let timing = record.timing.as_ref().expect("timing is on by default");
        assert!(timing.wall_ms >= timing.sample_ms && timing.sample_ms >= 0.0);
    }
}

#[test]
fn same_seed_same_jsonl_and_seeds_reach_the_sampler() {
    let go = |seed: u64| {
        let out = Shared::default();
        let sampler = Counting::new(script(), &out);
        let loom = loom(LoomConfig {
            rollouts_per_row: 3,
            seed,
            timing: false,
            concurrency: 4,
            ..LoomConfig::default()
        });
        run(&loom, &arithmetic(), &sampler, &out);
        (out.bytes(), sampler.calls())
    };
    let (first, calls) = go(7);
    let (second, _) = go(7);
    let (other, _) = go(8);
    assert_eq!(first, second, "same seed, same bytes");
    assert_ne!(first, other);

    // The seeds in the records are the derived ones, and differ only by seed between the runs.
    let (a, b) = (records(&first), records(&other));
    for (a, b) in a.iter().zip(&b) {
        assert_eq!(a.seed, rollout_seed(7, a.row_index, a.rollout_index));
        assert_eq!(b.seed, rollout_seed(8, b.row_index, b.rollout_index));
        assert_eq!(a.contexts, b.contexts);
    }
    // Every request carries a seed, all distinct: rollout seeds mixed with the turn.
    let seeds: Vec<u64> = calls
        .iter()
        .flat_map(|c| &c.requests)
        .map(|r| r.params.seed.expect("a seed"))
        .collect();
    assert_eq!(seeds.len(), 18);
    let distinct: std::collections::HashSet<_> = seeds.iter().collect();
    assert_eq!(distinct.len(), 18);
    assert_eq!(seeds[0], request_seed(rollout_seed(7, 0, 0), 0));
    assert_eq!(seeds[4], request_seed(rollout_seed(7, 0, 0), 1));
}

/// Fails the first request whose prompt mentions `needle`, answers the rest from the script.
struct FailOnce {
    inner: Scripted,
    needle: &'static str,
    failed: AtomicBool,
}

impl Sampler for FailOnce {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        Box::pin(async move {
            let mut results = self.inner.sample(batch).await;
            for (request, result) in batch.iter().zip(&mut results) {
                let hit = chat(request)
                    .iter()
                    .any(|m| m.content.contains(self.needle));
                if hit && !self.failed.swap(true, Ordering::SeqCst) {
                    *result = Err(SamplerError::Unavailable("injected: HTTP 503".into()));
                }
            }
            results
        })
    }
}

#[test]
fn a_failing_request_fails_one_rollout_only() {
    let out = Shared::default();
    let sampler = FailOnce {
        inner: script(),
        needle: "(1.5 + 2.5)",
        failed: AtomicBool::new(false),
    };
    let loom = loom(LoomConfig {
        rollouts_per_row: 4,
        ..LoomConfig::default()
    });
    let summary = run(&loom, &arithmetic(), &sampler, &out);
    assert_eq!(summary.rollouts, 12);
    assert_eq!(summary.failed, 1);
    assert_eq!(summary.failures[0].row_index, 1);
    assert_eq!(summary.failures[0].rollout_index, 0);
    assert_eq!(summary.failures[0].failure.stage, Stage::Sampler);
    let records = records(&out.bytes());
    assert_eq!(records.len(), 12);
    let failed: Vec<&RolloutRecord> = records.iter().filter(|r| r.error.is_some()).collect();
    assert_eq!(failed.len(), 1);
    let error = failed[0].error.as_ref().unwrap();
    assert_eq!(error.stage, Stage::Sampler);
    assert!(error.message.contains("injected: HTTP 503"), "{error:?}");
    // What it recorded before the failure is kept: the prompt, no sample, no reward.
    assert_eq!(failed[0].samples, 1);
    assert_eq!(failed[0].contexts[0].messages.len(), 2);
    assert!(failed[0].rewards.is_empty());
    // The other rollouts of the same row, and every other row, completed.
    let done = records
        .iter()
        .filter(|r| r.error.is_none() && r.samples == 2)
        .count();
    assert_eq!(done, 11);
    // The failed rollout counts against pass@k but not in the means.
    assert_eq!(summary.components[0].count, 11);
    assert!((summary.mean_reward.unwrap() - 4.0 / 11.0).abs() < 1e-12);
}

/// Answers one result fewer than asked.
struct Short(Scripted);

impl Sampler for Short {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        Box::pin(async move {
            let mut results = self.0.sample(batch).await;
            results.pop();
            results
        })
    }
}

#[test]
fn a_short_answer_from_the_sampler_fails_the_unanswered_rollouts() {
    let out = Shared::default();
    let summary = run(
        &loom(LoomConfig::default()),
        &arithmetic(),
        &Short(script()),
        &out,
    );
    // Each rollout's first request gets no answer.
    assert_eq!(summary.rollouts, 3);
    assert_eq!(summary.failed, 3);
    for failure in &summary.failures {
        assert_eq!(failure.failure.stage, Stage::Sampler);
        assert!(
            failure
                .failure
                .message
                .contains("returned 0 results for one request"),
            "{failure:?}"
        );
    }
}

/// Answers every request for length: the first turn of each rollout with text, later turns empty (a
/// prompt that already fills the model's context).
struct OutOfTokens;

impl Sampler for OutOfTokens {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        Box::pin(async move {
            batch
                .iter()
                .map(|request| {
                    let first_turn = chat(request).len() <= 2;
                    Ok(Completion {
                        text: if first_turn {
                            "<tool>".into()
                        } else {
                            String::new()
                        },
                        finish: Finish::Length,
                        ..Completion::default()
                    })
                })
                .collect()
        })
    }
}

#[test]
fn rollouts_out_of_tokens_end_truncated_not_failed() {
    let out = Shared::default();
    let summary = run(
        &loom(LoomConfig::default()),
        &arithmetic(),
        &OutOfTokens,
        &out,
    );
    assert_eq!(summary.failed, 0);
    let records = records(&out.bytes());
    assert_eq!(records.len(), 3);
    for record in &records {
        assert!(record.truncated, "{record:?}");
        assert!(record.error.is_none());
        // The empty answer to the second request ended the rollout: two samples, no third.
        assert_eq!(record.samples, 2);
    }
    let line = String::from_utf8(out.bytes()).unwrap();
    assert!(line.contains("\"truncated\":true"));
}

#[test]
fn the_run_future_is_send() {
    fn send<T: Send>(value: T) -> T {
        value
    }
    let loom = loom(LoomConfig::default());
    let (rows, sampler, mut out) = (arithmetic(), script(), Vec::new());
    let summary = block_on(send(loom.run(&rows, &sampler, &mut Jsonl(&mut out)))).unwrap();
    assert_eq!(summary.rollouts, 3);
}

#[test]
fn rows_lacking_an_input_run_no_rollout_and_the_rest_run() {
    let mut rows = arithmetic();
    rows[1].1.remove("query");
    let out = Shared::default();
    let summary = run(
        &loom(LoomConfig {
            rollouts_per_row: 2,
            ..LoomConfig::default()
        }),
        &rows,
        &script(),
        &out,
    );
    assert_eq!(summary.row_failures.len(), 1);
    assert_eq!(summary.row_failures[0].row_index, 1);
    assert!(
        summary.row_failures[0]
            .message
            .contains("missing column `query`"),
        "{:?}",
        summary.row_failures
    );
    assert_eq!(summary.rows, 2);
    assert_eq!(summary.rollouts, 4);
    assert_eq!(summary.failed, 0);
    let rows_run: Vec<usize> = records(&out.bytes()).iter().map(|r| r.row_index).collect();
    assert_eq!(rows_run, [0, 0, 2, 2]);
}

/// Answers each request with a function of it.
struct Answer<F>(F);

impl<F: Fn(&Request) -> String + Send + Sync> Sampler for Answer<F> {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        let results = batch
            .iter()
            .map(|request| {
                Ok(Completion {
                    text: (self.0)(request),
                    ..Completion::default()
                })
            })
            .collect();
        Box::pin(std::future::ready(results))
    }
}

#[test]
fn a_fence_in_progress_is_the_assistant_message_to_continue() {
    let holoware = Holoware::load(
        "fence.hol",
        b"<|o_o|>\n<|question|>\n<|@_@ <>think stop=END|>\n<|@_@:answer max_tokens=7 temperature=0.5 top_p=0.9 top_k=3|>\n",
        Arc::new(holotypes::registry()),
    )
    .unwrap();
    let loom = Loom::interpreted(
        Arc::new(holoware),
        Resources::default(),
        LoomConfig::default(),
    );
    let out = Shared::default();
    let sampler = Counting::new(
        Answer(|request: &Request| {
            if request.params.stop.is_empty() {
                " 42".to_string()
            } else {
                "hmm</think>".to_string()
            }
        }),
        &out,
    );
    let row: Row = serde_json::from_str(r#"{"question": "Q?"}"#).unwrap();
    let summary = run(&loom, &[(0, row)], &sampler, &out);
    assert_eq!(summary.failed, 0);
    let calls = sampler.calls();
    let first = &calls[0].requests[0];
    let messages = chat(first);
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[1].role, Role::Assistant);
    assert_eq!(messages[1].content, "<think>");
    assert_eq!(first.params.stop, ["</think>", "END"]);
    assert_eq!(first.params.max_tokens, None);
    // The second sampler continues the same assistant message, sampled text included.
    let second = &calls[1].requests[0];
    assert_eq!(chat(second)[1].content, "<think>hmm</think>");
    assert_eq!(second.params.max_tokens, Some(7));
    assert_eq!(second.params.temperature, Some(0.5));
    assert_eq!(second.params.top_p, Some(0.9));
    assert_eq!(second.params.top_k, Some(3));
    let record = &records(&out.bytes())[0];
    let parts: Vec<(&str, bool)> = record.contexts[0].messages[1]
        .parts
        .iter()
        .map(|p| (p.text.as_str(), p.sampled))
        .collect();
    assert_eq!(
        parts,
        [("<think>", false), ("hmm</think>", true), (" 42", true)]
    );
}

/// A hand-written rollout, as a compiled machine would be: asks one question, rewards `want`.
struct Echo {
    want: String,
    panic: bool,
    asked: bool,
    reply: Option<String>,
}

impl Rollout for Echo {
    fn step(&mut self, recorder: &mut dyn Recorder) -> Result<Step, RolloutError> {
        if self.panic {
            panic!("holotype exploded");
        }
        if !self.asked {
            self.asked = true;
            recorder.begin_context(true);
            recorder.begin_message(Role::User);
            recorder.text("say it");
            recorder.begin_message(Role::Assistant);
            return Ok(Step::Sample(SampleRequest {
                max_tokens: Some(4),
                ..SampleRequest::default()
            }));
        }
        let reply = self.reply.take().unwrap_or_default();
        recorder.reward("echo", f64::from(u8::from(reply == self.want)), 2.0);
        Ok(Step::Done)
    }

    fn resume(
        &mut self,
        completion: Completion,
        recorder: &mut dyn Recorder,
    ) -> Result<(), RolloutError> {
        recorder.completion(&completion);
        self.reply = Some(completion.text);
        Ok(())
    }
}

#[test]
fn boxed_rollouts_from_a_closure_with_start_failures_and_panics() {
    let source = |row: &Row| -> Result<Box<dyn Rollout + Send>, String> {
        let want = row["want"].as_str().ok_or("`want` must be a string")?;
        Ok(Box::new(Echo {
            want: want.to_string(),
            panic: want == "panic",
            asked: false,
            reply: None,
        }))
    };
    let loom = Loom::new(
        source,
        LoomConfig {
            rollouts_per_row: 2,
            // A closure's rollouts have no holoware to name the correctness component.
            pass_component: Some("echo".into()),
            ..LoomConfig::default()
        },
    );
    let rows: Vec<(usize, Row)> = [
        r#"{"want": "hi"}"#,
        r#"{"want": 3}"#,
        r#"{"want": "panic"}"#,
        r#"{"want": "nope"}"#,
    ]
    .iter()
    .map(|text| serde_json::from_str(text).unwrap())
    .enumerate()
    .collect();
    let out = Shared::default();
    let summary = run(&loom, &rows, &Scripted::new(["hi"]), &out);
    assert_eq!(summary.rollouts, 8);
    assert_eq!(summary.failed, 4);
    let records = records(&out.bytes());
    let stage = |row: usize| {
        records
            .iter()
            .filter(|r| r.row_index == row)
            .map(|r| r.error.as_ref().map(|e| (e.stage, e.message.as_str())))
            .collect::<Vec<_>>()
    };
    assert_eq!(stage(0), [None, None]);
    assert_eq!(
        stage(1),
        [Some((Stage::Start, "`want` must be a string")); 2]
    );
    assert_eq!(
        stage(2),
        [Some((Stage::Rollout, "panicked: holotype exploded")); 2]
    );
    assert_eq!(stage(3), [None, None]);
    let row0 = records.iter().find(|r| r.row_index == 0).unwrap();
    assert_eq!(row0.reward, 2.0);
    assert_eq!(row0.weights["echo"], 2.0);
    // Every row ran (a closure checks no row); only row 0 passes, and failed rollouts do not pass.
    assert_eq!(summary.rows, 4);
    assert_eq!(summary.pass_at_k, [(1, 0.25), (2, 0.25)]);
    assert_eq!(summary.mean_reward, Some(1.0));
}

/// `cargo test --release -p holo-core --test core loom:: -- --ignored --nocapture throughput`
///
/// 10,000 rollouts of tool.hol (2,500 rows × 4) through the Loom, JSONL to a file, against the same
/// rollouts driven by hand one at a time with nothing written; once with the tool turn (each calculator
/// call runs on a thread of its own, as `Tools::call` does) and once answering at once. `LOOM_C=N` sets
/// the Loom's concurrency (default 128).
#[test]
#[ignore = "a measurement: run it by hand"]
fn throughput_10k_rollouts_of_tool_hol() {
    let base = arithmetic();
    let rows: Vec<(usize, Row)> = (0..2500).map(|i| (i, base[i % 3].1.clone())).collect();
    let holoware = tool_hol();
    let resources = calculator();
    for (name, replies) in [
        ("tool call + answer", vec![TOOL_CALL, ANSWER]),
        ("answer only", vec![ANSWER]),
    ] {
        let loom = loom(LoomConfig {
            rollouts_per_row: 4,
            concurrency: std::env::var("LOOM_C").map_or(128, |c| c.parse().unwrap()),
            ..LoomConfig::default()
        });
        let path =
            std::env::temp_dir().join(format!("holo-loom-bench-{}.jsonl", std::process::id()));
        let mut file = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        let started = Instant::now();
        let summary = block_on(loom.run(
            &rows,
            &Scripted::new(replies.clone()),
            &mut Jsonl(&mut file),
        ))
        .unwrap();
        let elapsed = started.elapsed();
        drop(file);
        let bytes = std::fs::metadata(&path).unwrap().len();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(summary.rollouts, 10_000);
        assert_eq!(summary.failed, 0);

        let by_hand = Instant::now();
        for (_, row) in &rows {
            for _ in 0..4 {
                let mut sampler = Scripted::new(replies.clone());
                let mut transcript = holo_core::Transcript::default();
                let mut rollout = holoware.start_with(row, &resources).unwrap();
                while let Step::Sample(request) = rollout.step(&mut transcript).unwrap() {
                    let completion = sampler.complete(&request).unwrap();
                    rollout.resume(completion, &mut transcript).unwrap();
                }
            }
        }
        let by_hand = by_hand.elapsed();
        println!(
            "{name}: Loom {:.0} rollouts/s ({:.3} s, {} sampler calls, {:.1} MB JSONL); by hand {:.0} rollouts/s; Loom overhead {:.1} us/rollout",
            10_000.0 / elapsed.as_secs_f64(),
            elapsed.as_secs_f64(),
            summary.sampler_calls,
            bytes as f64 / 1e6,
            10_000.0 / by_hand.as_secs_f64(),
            (elapsed.as_secs_f64() - by_hand.as_secs_f64()) * 1e6 / 10_000.0
        );
    }
}

#[test]
fn scripted_as_a_sampler_answers_by_turn() {
    use holo_core::{ChatMessage, Finish, SampleParams};
    let message = |role, content: &str| ChatMessage {
        role,
        content: content.into(),
    };
    let request = |messages: Vec<ChatMessage>, stop: &[&str]| Request {
        prompt: Prompt::Chat(messages),
        params: SampleParams {
            stop: stop.iter().map(|s| s.to_string()).collect(),
            ..SampleParams::default()
        },
    };
    let sampler = Scripted::new(["first END more", "second"]);
    let batch = [
        request(vec![message(Role::User, "q")], &["END"]),
        request(
            vec![
                message(Role::User, "q"),
                message(Role::Assistant, "a"),
                message(Role::User, "r"),
            ],
            &[],
        ),
        // The assistant message in progress is not a finished turn.
        request(
            vec![
                message(Role::User, "q"),
                message(Role::Assistant, "<think>"),
            ],
            &[],
        ),
        // Past the end, the script starts again.
        request(
            vec![
                message(Role::Assistant, "1"),
                message(Role::Assistant, "2"),
                message(Role::User, "r"),
            ],
            &[],
        ),
    ];
    let results = block_on(sampler.sample(&batch));
    let texts: Vec<(String, Finish)> = results
        .into_iter()
        .map(|r| {
            let c = r.unwrap();
            (c.text, c.finish)
        })
        .collect();
    assert_eq!(
        texts,
        [
            ("first END".to_string(), Finish::Stop("END".into())),
            ("second".to_string(), Finish::EndOfTurn),
            ("first END more".to_string(), Finish::EndOfTurn),
            ("first END more".to_string(), Finish::EndOfTurn),
        ]
    );
    // Text prompts take the replies in order.
    let text = |t: &str| Request {
        prompt: Prompt::Text(t.into()),
        params: SampleParams::default(),
    };
    let results = block_on(sampler.sample(&[text("a"), text("b"), text("c")]));
    let texts: Vec<String> = results.into_iter().map(|r| r.unwrap().text).collect();
    assert_eq!(texts, ["first END more", "second", "first END more"]);
    // An empty script rejects.
    let empty = Scripted::new(Vec::<String>::new());
    let results = block_on(empty.sample(&[text("a")]));
    assert!(matches!(results[0], Err(SamplerError::Rejected(_))));
}

#[test]
fn resume_runs_only_what_was_not_done_and_summarizes_everything() {
    let config = LoomConfig {
        rollouts_per_row: 2,
        seed: 11,
        timing: false,
        concurrency: 8,
        ..LoomConfig::default()
    };
    let rows = arithmetic();
    let full_out = Shared::default();
    let full = run(&loom(config.clone()), &rows, &script(), &full_out);
    let all = records(&full_out.bytes());

    // Half of them done before the interruption.
    let done: Vec<RolloutRecord> = all.iter().step_by(2).cloned().collect();
    let out = Shared::default();
    let sampler = Counting::new(script(), &out);
    let resumed =
        block_on(loom(config.clone()).resume(&rows, &done, &sampler, &mut Jsonl(out.clone())))
            .unwrap();
    let written = records(&out.bytes());
    assert_eq!(
        written.len(),
        all.len() - done.len(),
        "done rollouts are not run again"
    );
    let mut together: Vec<RolloutRecord> = done.iter().chain(&written).cloned().collect();
    let mut expected = all.clone();
    let key = |r: &RolloutRecord| (r.row_index, r.rollout_index);
    together.sort_by_key(key);
    expected.sort_by_key(key);
    assert_eq!(
        together, expected,
        "the others run with the seeds they would have had"
    );
    assert_eq!(resumed.rollouts, full.rollouts);
    assert_eq!(resumed.mean_reward, full.mean_reward);
    assert_eq!(resumed.pass_at_k, full.pass_at_k);

    // Records the run would not have made are refused before anything runs.
    let refused = |records: Vec<RolloutRecord>| {
        let out = Shared::default();
        let error = block_on(loom(config.clone()).resume(
            &rows,
            &records,
            &script(),
            &mut Jsonl(out.clone()),
        ))
        .unwrap_err();
        assert_eq!(out.bytes(), b"");
        error.to_string()
    };
    let mut other_seed = all[0].clone();
    other_seed.seed ^= 1;
    assert!(refused(vec![other_seed]).contains("another run seed"));
    let mut failed = all[0].clone();
    failed.error = Some(holo_core::loom::Failure {
        stage: Stage::Sampler,
        message: "timeout".into(),
    });
    assert!(refused(vec![failed]).contains("it failed"));
    assert!(refused(vec![all[0].clone(), all[0].clone()]).contains("twice"));
    let mut no_row = all[0].clone();
    no_row.row_index = 99;
    assert!(refused(vec![no_row]).contains("no such row"));
}

/// Where [`Gate`]s meet: how many rollouts are inside one, out of `expected`.
struct Meeting {
    inside: Mutex<usize>,
    changed: std::sync::Condvar,
    expected: usize,
}

/// A holotype that blocks (as code in the sandbox does) until `expected` rollouts are inside it at
/// once, or fails after a deadline saying how many made it: rollouts stepped one after another never
/// meet.
struct Gate(Arc<Meeting>);

impl holo_core::Holotype for Gate {
    const BLOCKS: bool = true;
    const PARAMS: &'static [&'static str] = &[];

    fn new(args: &holo_core::Args) -> Result<Self, holo_core::HolotypeError> {
        let meeting = args
            .resources
            .get::<Meeting>()
            .ok_or_else(|| holo_core::HolotypeError::new("no Meeting in the resources"))?;
        Ok(Gate(meeting))
    }

    fn enter(
        &mut self,
        _cx: &mut holo_core::Cx<'_>,
    ) -> Result<holo_core::Enter, holo_core::HolotypeError> {
        let meeting = &self.0;
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        let mut inside = meeting.inside.lock().unwrap();
        *inside += 1;
        meeting.changed.notify_all();
        while *inside < meeting.expected {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(holo_core::HolotypeError::new(format!(
                    "after 30 s only {} of {} rollouts were inside their blocking step at once",
                    *inside, meeting.expected
                )));
            }
            inside = meeting.changed.wait_timeout(inside, left).unwrap().0;
        }
        Ok(holo_core::Enter::Run)
    }
}

#[test]
fn rollouts_whose_holotypes_block_run_beside_each_other_off_the_sampling_thread() {
    let mut registry = holotypes::registry();
    registry.register::<Gate>("Gate");
    let holoware = Arc::new(
        Holoware::load(
            "gate.hol",
            b"<|o_o|>\nGo.\n<|Gate|>\n<|@_@:reply|>\n",
            Arc::new(registry),
        )
        .unwrap(),
    );
    assert!(holoware.blocks(), "Gate::BLOCKS makes the holoware block");
    assert!(
        !tool_hol().blocks(),
        "the calculator's tool.hol steps in place"
    );
    let codemath = Holoware::open(
        &repo().join("hol/codemath.hol"),
        Arc::new(holotypes::registry()),
    )
    .unwrap();
    assert!(codemath.blocks(), "CodeExecutor blocks");

    let mut resources = Resources::default();
    resources.insert(Meeting {
        inside: Mutex::new(0),
        changed: std::sync::Condvar::new(),
        expected: 4,
    });
    let loom = Loom::interpreted(
        holoware,
        resources,
        LoomConfig {
            rollouts_per_row: 4,
            concurrency: 4,
            ..LoomConfig::default()
        },
    );
    let rows = [(0, Row::new())];
    let out = Shared::default();
    // One runtime thread: were the Gates stepped on it, the first would hold it, and nothing else.
    let summary = run(&loom, &rows, &Scripted::new(["done"]), &out);
    let records = records(&out.bytes());
    assert_eq!(summary.rollouts, 4);
    assert!(
        records.iter().all(|record| record.error.is_none()),
        "{:?}",
        records
            .iter()
            .map(|record| &record.error)
            .collect::<Vec<_>>()
    );
}
