//! What the chaos cases share: `holo` runs bounded by a deadline, the rows and environment of an
//! evaluation, the records a run wrote, and signals to processes.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::common::holo_command;
use crate::common::process::Process;

/// `holo ARGS` as a child whose output goes to `DIR/LABEL.log`.
pub fn spawn(dir: &Path, label: &str, args: &[String]) -> Process {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Process::spawn(&mut holo_command(&args), dir.join(format!("{label}.log")))
}

/// `holo ARGS` run to its end, which must come within `limit` (the test fails naming the run and its
/// output otherwise): its exit code and output.
pub fn run(dir: &Path, label: &str, args: &[String], limit: Duration) -> (i32, String) {
    let (status, output) = spawn(dir, label, args).finish(limit);
    (status.code().unwrap_or(-1), output)
}

/// Strings from string slices.
pub fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|arg| arg.to_string()).collect()
}

#[cfg(feature = "local")]
pub use crate::common::fixture;

/// `count` rows that differ in their question (`What is I+7?`), written to `DIR/rows.jsonl`.
#[cfg(feature = "local")]
pub fn rows(dir: &Path, count: usize) -> std::path::PathBuf {
    let path = dir.join("rows.jsonl");
    let text: String = (0..count)
        .map(|row| format!("{{\"question\": \"What is {row}+7?\"}}\n"))
        .collect();
    std::fs::write(&path, text).unwrap();
    path
}

/// The question of row `row` of [`rows`], as it appears in a request's prompt.
#[cfg(feature = "local")]
pub fn question(row: usize) -> String {
    format!("What is {row}+7?")
}

/// The JSON lines of a file (none when it does not exist).
pub fn records(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// The records of `records` that completed, by `(row, rollout)`, without their timings.
#[cfg(feature = "local")]
pub fn completed(records: &[Value]) -> Vec<((u64, u64), Value)> {
    let mut done: Vec<((u64, u64), Value)> = records
        .iter()
        .filter(|record| record["error"].is_null())
        .map(|record| {
            let mut record = record.clone();
            record.as_object_mut().unwrap().remove("timing");
            (
                (
                    record["row_index"].as_u64().unwrap(),
                    record["rollout_index"].as_u64().unwrap(),
                ),
                record,
            )
        })
        .collect();
    done.sort_by_key(|(key, _)| *key);
    done
}

/// The error messages of the records that failed.
#[cfg(feature = "local")]
pub fn failures(records: &[Value]) -> Vec<String> {
    records
        .iter()
        .filter(|record| !record["error"].is_null())
        .map(|record| record["error"]["message"].as_str().unwrap().to_string())
        .collect()
}

/// Sends `signal` to process `pid`.
#[cfg(feature = "local")]
pub fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) on a child of this test, which has not been reaped while the test holds it.
    let sent = unsafe { libc::kill(pid as libc::pid_t, signal) };
    assert_eq!(sent, 0, "kill({pid}, {signal}) failed");
}

/// Runs `case` for each seed on threads of its own: each case waits on its own deadlines, not on the
/// others'.
pub fn each_seed(seeds: &[u64], case: impl Fn(u64) + Sync) {
    std::thread::scope(|scope| {
        let runs: Vec<_> = seeds
            .iter()
            .map(|&seed| {
                let case = &case;
                (seed, scope.spawn(move || case(seed)))
            })
            .collect();
        for (seed, handle) in runs {
            if let Err(panic) = handle.join() {
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("seed {seed}: {message}");
            }
        }
    });
}

/// `holo train` of the short test environment on the committed tiny Qwen2 for `steps` steps into `out`,
/// a checkpoint after every step, with the run seed `seed` and `extra` options.
#[cfg(feature = "local")]
pub fn train_args(out: &Path, steps: u32, seed: u64, extra: &[&str]) -> Vec<String> {
    let mut args = crate::common::tiny_train("train/short.hol", "train/rows.jsonl", out);
    args.extend(strings(&[
        "--max-steps",
        &steps.to_string(),
        "--num-generations",
        "4",
        "--per-device-train-batch-size",
        "4",
        "--max-completion-length",
        "8",
        "--save-steps",
        "1",
        "--seed",
        &seed.to_string(),
    ]));
    args.extend(strings(extra));
    args
}

/// The steps of a run folder's complete checkpoints, in order.
#[cfg(feature = "local")]
pub fn checkpoints(run: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(run)
        .map(|entries| {
            entries
                .filter_map(|entry| {
                    let name = entry.ok()?.file_name().into_string().ok()?;
                    name.strip_prefix("checkpoint-")?.parse().ok()
                })
                .collect()
        })
        .unwrap_or_default();
    steps.sort();
    steps
}

/// Every file under `dir` with its bytes, by path relative to it.
#[cfg(feature = "local")]
pub fn snapshot(dir: &Path) -> std::collections::BTreeMap<std::path::PathBuf, Vec<u8>> {
    let mut files = std::collections::BTreeMap::new();
    let mut folders = vec![dir.to_path_buf()];
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                folders.push(path);
            } else {
                let relative = path.strip_prefix(dir).unwrap().to_path_buf();
                files.insert(relative, std::fs::read(&path).unwrap());
            }
        }
    }
    files
}
