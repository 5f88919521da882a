//! Holotypes that misbehave inside the Loom: model-written code that never ends (CodeExecutor in the
//! sandbox, through `holo eval`), and a Rust holotype that panics (in place, and on the blocking pool
//! as a holotype that blocks is stepped).
//!
//! Code past its time limit is stopped by the sandbox, everything it started included, and the rollout
//! goes on with the error as the code's output. A panic fails its own rollout only, its record naming
//! the panic; the other rollouts complete, and a resumed run runs exactly the failed ones again with
//! the seeds they had.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use holo_runtime::holotypes;
use holo_runtime::interpreter::{Holoware, Row};
use holo_runtime::loom::{Loom, LoomConfig, RolloutRecord};
use holo_runtime::{Args, Cx, Enter, Holotype, HolotypeError, Resources, Scripted};
use serde_json::json;

use crate::common::components;
use crate::common::tempdir::Dir;
use crate::support::{each_seed, records, run, strings};

/// Programs that never end on their own, each with a way of its own: a busy loop, a sleep, a
/// deadlock, and a busy loop beside a daemon of its own (a child in a new session, named `marker`).
fn endless_programs(marker: &str) -> [String; 4] {
    [
        "while True:\n    pass".into(),
        "import time\ntime.sleep(10**6)".into(),
        "import threading\nlock = threading.Lock()\nlock.acquire()\nlock.acquire()".into(),
        format!(
            "import os\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', [{marker:?}, '600'])\nwhile True:\n    pass"
        ),
    ]
}

/// The processes of this machine whose command line holds `text`.
fn processes_with(text: &str) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| {
            let entry = entry.ok()?;
            entry.file_name().to_str()?.parse::<u32>().ok()?;
            let command = std::fs::read(entry.path().join("cmdline")).ok()?;
            let command = String::from_utf8_lossy(&command).replace('\0', " ");
            command.contains(text).then_some(command)
        })
        .collect()
}

#[test]
fn code_that_never_ends_is_stopped_at_the_sandbox_time_limit_and_the_rollout_goes_on() {
    if !components::sandbox() {
        return;
    }
    let dir = Dir::new("chaos-sandbox-timeout");
    let marker = format!("holo-chaos-daemon-{}", std::process::id());
    // The environment runs the row's program as if the model had written it.
    let hol = dir.join("endless.hol");
    std::fs::write(
        &hol,
        "<|+++|>\n<|o_o|>\n<|question|>\n\n<|@_@:reply|>\n<|o_o|>\n<|CodeExecutor program timeout=1 processes=8|>\n<|LengthPenalty var=reply max=24|>\n",
    )
    .unwrap();
    let programs = endless_programs(&marker);
    let rows: String = programs
        .iter()
        .enumerate()
        .map(|(row, program)| {
            let code = format!("<code>print('started', flush=True)\n{program}</code>");
            format!(
                "{}\n",
                json!({"question": format!("q{row}"), "program": code})
            )
        })
        .collect();
    let data = dir.join("rows.jsonl");
    std::fs::write(&data, rows).unwrap();
    let out = dir.join("rollouts.jsonl");
    let args = strings(&[
        "eval",
        hol.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--reply",
        "ok",
    ]);
    let (code, output) = run(&dir, "endless", &args, Duration::from_secs(60));
    assert_eq!(code, 0, "{output}");
    let written = records(&out);
    assert_eq!(written.len(), programs.len(), "{output}");
    for record in &written {
        assert!(record["error"].is_null(), "{record}");
        let messages = record["contexts"][0]["messages"].as_array().unwrap();
        let told = messages.last().unwrap()["parts"][0]["text"]
            .as_str()
            .unwrap();
        assert_eq!(
            told, "<output>started\nerror: the code timed out after 1 s and was stopped</output>",
            "row {}: the program ran, and the model is told why it stopped",
            record["row_index"]
        );
        assert!(record["rewards"]["length_penalty"].is_number(), "{record}");
    }
    assert_eq!(
        processes_with(&marker),
        Vec::<String>::new(),
        "the daemon the code started is stopped with it"
    );
}

/// Whether the panicking holotypes panic (a resumed run disarms them).
struct Armed(AtomicBool);

/// Panics in `enter` on rows whose `boom` is `enter`, in `end` on rows whose `boom` is `end`; with
/// `BLOCKS` the Loom steps its rollouts on Tokio's blocking pool.
struct Boom<const BLOCKS: bool> {
    armed: Arc<Armed>,
}

impl<const BLOCKS: bool> Boom<BLOCKS> {
    fn panic_at(&self, cx: &Cx<'_>, place: &str) {
        if self.armed.0.load(Ordering::SeqCst) && cx.var("boom") == Some(place) {
            panic!("boom in {place} on {:?}", cx.var("question").unwrap_or("?"));
        }
    }
}

impl<const BLOCKS: bool> Holotype for Boom<BLOCKS> {
    const PARAMS: &'static [&'static str] = &[];
    const BLOCKS: bool = BLOCKS;

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        let armed = args
            .resources
            .get::<Armed>()
            .ok_or_else(|| HolotypeError::new("no Armed in the resources"))?;
        Ok(Boom { armed })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        self.panic_at(cx, "enter");
        Ok(Enter::Run)
    }

    fn end(&mut self, cx: &mut Cx<'_>) -> Result<(), HolotypeError> {
        self.panic_at(cx, "end");
        Ok(())
    }
}

/// Runs `loom` on `rows` (resuming after `done`) to its end, which must come within 30 s.
fn run_loom(
    runtime: &tokio::runtime::Runtime,
    loom: &Loom<holo_runtime::loom::Interpreted>,
    rows: &[(usize, Row)],
    done: &[RolloutRecord],
) -> Vec<RolloutRecord> {
    let mut out: Vec<RolloutRecord> = Vec::new();
    let sampler = Scripted::new(["<answer>42</answer>"]);
    let finished = runtime.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(30),
            loom.resume(rows, done, &sampler, &mut out),
        )
        .await
    });
    let summary = finished
        .expect("the Loom did not finish within 30 s")
        .unwrap();
    assert_eq!(summary.rollouts, done.len() + out.len());
    out
}

#[test]
fn a_panicking_holotype_fails_its_rollout_only_naming_the_panic_and_resume_reruns_it() {
    // Seed s: row i panics in `enter` when (i + s) % 4 is 0, in `end` when it is 1.
    each_seed(&[0, 1, 2], |seed| {
        for blocks in [false, true] {
            let mut registry = holotypes::registry();
            if blocks {
                registry.register::<Boom<true>>("Boom");
            } else {
                registry.register::<Boom<false>>("Boom");
            }
            let source = "<|o_o|>\n<|question|>\n<|Boom|>\n<|@_@:reply|>\n<|LengthPenalty var=reply max=24|>\n";
            let holoware = Arc::new(
                Holoware::load("boom.hol", source.as_bytes(), Arc::new(registry)).unwrap(),
            );
            assert_eq!(holoware.blocks(), blocks);
            let mut resources = Resources::default();
            resources.insert(Armed(AtomicBool::new(true)));
            let armed = resources.get::<Armed>().unwrap();
            let rows: Vec<(usize, Row)> = (0..8)
                .map(|row| {
                    let boom = ["enter", "end", "no", "no"][(row + seed as usize) % 4];
                    let value = json!({"question": format!("What is {row}+7?"), "boom": boom});
                    (row, value.as_object().unwrap().clone())
                })
                .collect();
            let loom = Loom::interpreted(
                holoware,
                resources,
                LoomConfig {
                    rollouts_per_row: 2,
                    seed,
                    concurrency: 4,
                    ..LoomConfig::default()
                },
            );
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let first = run_loom(&runtime, &loom, &rows, &[]);
            assert_eq!(first.len(), 16, "every rollout is written");
            let failed: BTreeMap<(usize, usize), &RolloutRecord> = first
                .iter()
                .filter(|record| record.error.is_some())
                .map(|record| ((record.row_index, record.rollout_index), record))
                .collect();
            assert_eq!(
                failed.len(),
                8,
                "the rows with a panic, and only those, fail"
            );
            for ((row, _), record) in &failed {
                let boom = rows[*row].1["boom"].as_str().unwrap();
                let message = &record.error.as_ref().unwrap().message;
                // The tag that panicked is named by its place in the file, as a returned error is.
                assert!(
                    message.contains(&format!(
                        "boom.hol:3:1: panicked: boom in {boom} on \"What is {row}+7?\""
                    )),
                    "blocks {blocks}: {message}"
                );
            }

            // Disarmed, a resume runs exactly the failed rollouts again, with their seeds.
            armed.0.store(false, Ordering::SeqCst);
            let done: Vec<RolloutRecord> = first
                .iter()
                .filter(|record| record.error.is_none())
                .cloned()
                .collect();
            let second = run_loom(&runtime, &loom, &rows, &done);
            let rerun: BTreeMap<(usize, usize), &RolloutRecord> = second
                .iter()
                .map(|record| ((record.row_index, record.rollout_index), record))
                .collect();
            assert_eq!(
                rerun.keys().collect::<Vec<_>>(),
                failed.keys().collect::<Vec<_>>()
            );
            for (key, record) in &rerun {
                assert!(record.error.is_none(), "{:?}", record.error);
                assert_eq!(record.seed, failed[key].seed);
            }
        }
    });
}
