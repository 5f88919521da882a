//! The trials: one trainer's run killed and resumed until it finishes, then compared with the run never
//! interrupted ([`trials`]).

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use holo_runtime::train::kill;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::common::tempdir::Dir;
use crate::common::{holo_command, json, run_metrics};

/// Trials per trainer when `HOLO_KILL_TRIALS` is unset: enough to pass through a checkpoint write and a
/// random instant of each trainer in a quick `cargo test`.
const DEFAULT_TRIALS: u64 = 3;

/// How long one `holo` process may take (a debug build runs these runs in about a second; the limit is
/// for a machine whose cores other test binaries share).
const PROCESS_LIMIT: Duration = Duration::from_secs(300);

/// One trainer's run, as every trial repeats it.
pub struct Recipe {
    /// The trainer's name, in messages and in the seeds of its trials.
    pub name: &'static str,
    /// The `holo` arguments of the run into the folder given (without `--resume`).
    pub args: fn(&Path) -> Vec<String>,
    /// Its optimizer steps; a checkpoint every `save_steps` of them and after the last.
    pub steps: u64,
    pub save_steps: u64,
    /// Its `save_total_limit`: the newest checkpoints kept.
    pub keep: u64,
    /// The kill points each save of this run passes (holo-train's `kill` module).
    pub save_points: &'static [&'static str],
    /// The kill points a resume from a checkpoint passes, each with how many times it passes it.
    pub resume_points: &'static [(&'static str, u64)],
    /// Whether the run writes `rollouts.jsonl` and `eval_rollouts.jsonl`.
    pub rollouts: bool,
}

impl Recipe {
    /// The checkpoints a run still writes once the one of step `done` is there.
    fn saves_after(&self, done: u64) -> u64 {
        (done + 1..=self.steps)
            .filter(|step| step.is_multiple_of(self.save_steps) || *step == self.steps)
            .count() as u64
    }

    /// How many times a run whose folder is `out` will pass each of the kill points of a save; the
    /// resume's own points when it resumes from a checkpoint.
    fn points_ahead(&self, out: &Path, resume: bool) -> Vec<(&'static str, u64)> {
        let checkpoints = holo_runtime::train::checkpoint::RunDir::new(out)
            .checkpoints()
            .unwrap();
        let done = checkpoints.last().map_or(0, |(step, _)| *step);
        let saves = self.saves_after(done);
        // Every checkpoint beyond the newest `keep` is removed, by the resume or by a later save.
        let removals = (checkpoints.len() as u64 + saves).saturating_sub(self.keep);
        let mut points: Vec<(&'static str, u64)> = self
            .save_points
            .iter()
            .map(|&point| (point, if point == REMOVING { removals } else { saves }))
            .filter(|(_, passes)| *passes > 0)
            .collect();
        if resume && done > 0 {
            points.extend(self.resume_points);
        }
        points
    }
}

/// The kill point of a checkpoint's removal, which only saves beyond `save_total_limit` pass.
const REMOVING: &str = "checkpoint:removing";

/// Where a trial kills a run.
#[derive(Debug, Clone)]
enum Kill {
    /// The run kills itself the `occurrence`-th time it reaches `point` (`HOLO_KILL_AT`).
    At {
        point: &'static str,
        occurrence: u64,
    },
    /// SIGKILL from here once the run has written `lines` lines to stderr and `delay` has passed since.
    After { lines: usize, delay: Duration },
}

/// How a `holo` process ended.
enum Ended {
    Finished,
    /// By SIGKILL (ours, or its own at a kill point).
    Killed,
    Failed(String),
}

/// A `holo` process whose stderr lines arrive through a channel, so that every wait on it has a
/// deadline; killed when dropped.
struct Watched {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
    deadline: Instant,
    what: String,
}

impl Watched {
    fn start(recipe: &Recipe, out: &Path, resume: bool, kill: Option<&Kill>) -> Watched {
        let mut args = (recipe.args)(out);
        if resume {
            args.push("--resume".into());
        }
        let what = format!("holo {}", args.join(" "));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut command = holo_command(&args);
        command
            .env_remove(kill::VARIABLE)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(Kill::At { point, occurrence }) = kill {
            command.env(kill::VARIABLE, format!("{point}@{occurrence}"));
        }
        let mut child = command.spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (sender, lines) = mpsc::channel();
        // The reader ends when the process closes stderr, that is when it ends.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Watched {
            child,
            lines,
            seen: Vec::new(),
            deadline: Instant::now() + PROCESS_LIMIT,
            what,
        }
    }

    /// Waits for the next stderr line; false when the process closed stderr (it ended).
    fn next_line(&mut self) -> bool {
        let left = self.deadline.saturating_duration_since(Instant::now());
        match self.lines.recv_timeout(left) {
            Ok(line) => {
                self.seen.push(line);
                true
            }
            Err(RecvTimeoutError::Disconnected) => false,
            Err(RecvTimeoutError::Timeout) => panic!(
                "{} did not end within {PROCESS_LIMIT:?}; its stderr so far:\n{}",
                self.what,
                self.seen.join("\n")
            ),
        }
    }

    /// Reads stderr to its end and waits for the exit status.
    fn finish(&mut self) -> ExitStatus {
        while self.next_line() {}
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < self.deadline,
                "{} closed stderr but did not exit within {PROCESS_LIMIT:?}",
                self.what
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn stderr(&self) -> String {
        self.seen.join("\n")
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs one `holo` process of a trial with its kill; how it ended and its stderr.
fn run(recipe: &Recipe, out: &Path, resume: bool, kill: Option<&Kill>) -> (Ended, String) {
    let mut watched = Watched::start(recipe, out, resume, kill);
    if let Some(Kill::After { lines, delay }) = kill {
        let mut reached = true;
        while watched.seen.len() < *lines {
            if !watched.next_line() {
                reached = false;
                break;
            }
        }
        if reached {
            // Timing only picks the instant; nothing checked depends on where it lands.
            std::thread::sleep(*delay);
            // A process that ended meanwhile is not killed: its status says it finished.
            let _ = watched.child.kill();
        }
    }
    let status = watched.finish();
    let ended = if status.success() {
        Ended::Finished
    } else if status.signal() == Some(libc::SIGKILL) {
        Ended::Killed
    } else {
        Ended::Failed(format!(
            "{} ended with {status}:\n{}",
            watched.what,
            watched.stderr()
        ))
    };
    (ended, watched.stderr())
}

/// The run never interrupted, and how it writes to stderr over time (where the random instants fall).
pub struct Reference {
    _dir: Dir,
    out: PathBuf,
    /// Its time from start to end over its stderr lines and one: the span of a random instant's delay.
    gap: Duration,
}

impl Reference {
    fn run(recipe: &Recipe) -> Reference {
        let dir = Dir::new(&format!("kill-{}-reference", recipe.name));
        let out = dir.join("run");
        let started = Instant::now();
        let (ended, stderr) = run(recipe, &out, false, None);
        if let Ended::Failed(message) = ended {
            panic!("the uninterrupted {} run failed: {message}", recipe.name);
        }
        let lines = stderr.lines().count();
        Reference {
            _dir: dir,
            out,
            gap: started.elapsed() / (lines as u32 + 1),
        }
    }
}

/// What trials did: kills that landed (the run died by them), those inside a checkpoint write, the
/// `--resume` runs started.
#[derive(Default)]
struct Counts {
    kills: u64,
    inside_saves: u64,
    resumes: u64,
}

/// Whether a save's temporary folder is in `out`: a kill landed between its creation and its rename.
fn save_interrupted(out: &Path) -> bool {
    std::fs::read_dir(out).is_ok_and(|entries| {
        entries.flatten().any(|entry| {
            entry
                .file_name()
                .to_str()
                .is_some_and(|name| name.starts_with(".checkpoint-") && name.ends_with(".tmp"))
        })
    })
}

/// The next kill of a trial whose run folder is `out`. `turn` asks for a kill point, the save's points
/// taken in turn, else the kind is drawn.
fn choose(
    random: &mut ChaCha8Rng,
    recipe: &Recipe,
    reference: &Reference,
    out: &Path,
    resume: bool,
    turn: Option<usize>,
) -> Kill {
    let points = recipe.points_ahead(out, resume);
    let at_point = turn.is_some() || random.random_bool(0.5);
    if at_point && !points.is_empty() {
        let (point, passes) = match turn {
            Some(turn) => points[turn % points.len()],
            None => points[random.random_range(0..points.len())],
        };
        return Kill::At {
            point,
            occurrence: random.random_range(1..=passes),
        };
    }
    // The run writes a line as it starts training and one per checkpoint: an instant after one of the
    // lines it still writes, before the next.
    let done = holo_runtime::train::checkpoint::RunDir::new(out)
        .checkpoints()
        .unwrap()
        .last()
        .map_or(0, |(step, _)| *step);
    Kill::After {
        lines: random.random_range(0..=recipe.saves_after(done) as usize),
        delay: Duration::from_micros(random.random_range(0..=reference.gap.as_micros() as u64)),
    }
}

/// The seed of a trial: the trainer's name (FNV-1a) and the trial's number.
fn seed(name: &str, index: u64) -> u64 {
    let name = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    });
    name ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Trial `index`: the run killed one to three times, resumed after each kill, then compared with the
/// reference. An error says what the trial did up to the failure.
fn trial(recipe: &Recipe, reference: &Reference, index: u64) -> Result<Counts, String> {
    let mut random = ChaCha8Rng::seed_from_u64(seed(recipe.name, index));
    let kills = random.random_range(1..=3);
    killed_and_resumed(
        recipe,
        reference,
        &format!("trial {index}"),
        false,
        |out, attempt| {
            // Every other trial's first kill is at a save's kill point, taking the points in turn.
            let turn = (attempt == 0 && index.is_multiple_of(2)).then_some(index as usize / 2);
            (attempt < kills)
                .then(|| choose(&mut random, recipe, reference, out, attempt > 0, turn))
        },
    )
}

/// The run killed by the kill `next` gives for each of its attempts (given the run folder and the
/// attempt's number), resumed after each, until an attempt without a kill; then compared with the
/// reference. With `must_land`, a kill that did not land (the run finished first) is a failure.
fn killed_and_resumed(
    recipe: &Recipe,
    reference: &Reference,
    label: &str,
    must_land: bool,
    mut next: impl FnMut(&Path, usize) -> Option<Kill>,
) -> Result<Counts, String> {
    let dir = Dir::new(&format!("kill-{}", recipe.name));
    let out = dir.join("run");
    let mut counts = Counts::default();
    let mut history = Vec::new();
    let fail = |history: &[String], message: &str| {
        format!(
            "{} {label}: {}\n{message}",
            recipe.name,
            history.join(", then ")
        )
    };
    for attempt in 0.. {
        let resume = attempt > 0;
        let kill = next(&out, attempt);
        history.push(format!(
            "{} {kill:?}",
            if resume { "--resume" } else { "run" }
        ));
        counts.resumes += u64::from(resume);
        let (ended, stderr) = run(recipe, &out, resume, kill.as_ref());
        match (ended, &kill) {
            (Ended::Finished, Some(_)) if must_land => {
                return Err(fail(&history, "the run finished before its kill"))
            }
            (Ended::Finished, _) => {
                let compared =
                    panic::catch_unwind(AssertUnwindSafe(|| compare(recipe, reference, &out)));
                return match compared {
                    Ok(()) => Ok(counts),
                    Err(panic) => Err(fail(&history, &panic_message(&panic))),
                };
            }
            (Ended::Killed, Some(Kill::At { point, .. })) => {
                if !stderr.contains(&format!("{}: killed at {point}", kill::VARIABLE)) {
                    return Err(fail(
                        &history,
                        &format!("killed, not at its point:\n{stderr}"),
                    ));
                }
                counts.kills += 1;
                counts.inside_saves += u64::from(point.starts_with("checkpoint:"));
            }
            (Ended::Killed, Some(Kill::After { .. })) => {
                counts.kills += 1;
                counts.inside_saves += u64::from(save_interrupted(&out));
            }
            (Ended::Killed, None) => {
                return Err(fail(&history, "killed by something else than the trial"))
            }
            (Ended::Failed(message), _) => return Err(fail(&history, &message)),
        }
    }
    unreachable!("attempts go on until one finishes, fails or panics")
}

/// Runs `recipe` once per scenario, killed at each of the scenario's points in turn (`(name,
/// occurrence)`), resumed after each; each kill must land and each run must end as the reference.
pub fn scenarios(recipe: &Recipe, scenarios: &[&[(&'static str, u64)]]) {
    let reference = Reference::run(recipe);
    let failures: Vec<String> = scenarios
        .iter()
        .filter_map(|kills| {
            let label = format!("{kills:?}");
            let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
                killed_and_resumed(recipe, &reference, &label, true, |_, attempt| {
                    kills
                        .get(attempt)
                        .map(|&(point, occurrence)| Kill::At { point, occurrence })
                })
            }));
            match outcome {
                Ok(Ok(_)) => None,
                Ok(Err(message)) => Some(message),
                Err(panic) => Some(format!("{label}: {}", panic_message(&panic))),
            }
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Asserts that the run in `out` wrote what the reference did: the same metrics (wall-clock figures
/// aside), the same checkpoints with byte-identical final ones, the same rollouts, nothing left over.
fn compare(recipe: &Recipe, reference: &Reference, out: &Path) {
    let (expected, actual) = (run_metrics(&reference.out), run_metrics(out));
    assert_eq!(actual.len(), expected.len(), "metrics.jsonl lines");
    for (line, (a, b)) in actual.iter().zip(&expected).enumerate() {
        assert_eq!(a, b, "metrics.jsonl line {}", line + 1);
    }
    // The run folder's entries: the same checkpoints, no temporary folder or file left.
    let entries = |dir: &Path| {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    };
    assert_eq!(entries(out), entries(&reference.out), "the run folder");
    let last = format!("checkpoint-{}", recipe.steps);
    for name in entries(&reference.out.join(&last)) {
        let read = |dir: &Path| std::fs::read(dir.join(&last).join(&name)).unwrap();
        assert!(
            read(out) == read(&reference.out),
            "{last}/{name} differs from the uninterrupted run's"
        );
    }
    if recipe.rollouts {
        for file in ["rollouts.jsonl", "eval_rollouts.jsonl"] {
            let (a, b) = (records(&out.join(file)), records(&reference.out.join(file)));
            assert_eq!(a.len(), b.len(), "{file}: records");
            for (a, b) in a.iter().zip(&b) {
                json::assert_close(
                    a,
                    b,
                    &format!(
                        "{file}: step {} row {} rollout {}",
                        a["step"], a["row_index"], a["rollout_index"]
                    ),
                );
            }
        }
    }
}

/// The records of a rollout file by step, row and rollout: they are written as rollouts finish, in an
/// order the scheduler's timing decides.
fn records(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut records: Vec<serde_json::Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    records.sort_by_key(|r| {
        (
            r["step"].as_u64(),
            r["row_index"].as_u64(),
            r["rollout_index"].as_u64(),
        )
    });
    records
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Runs `HOLO_KILL_TRIALS` trials of `recipe` (default [`DEFAULT_TRIALS`]) after its uninterrupted run,
/// prints its counts on one `kill-trials` line, and fails listing the trials that failed.
pub fn trials(recipe: &Recipe) {
    let count = match std::env::var("HOLO_KILL_TRIALS") {
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| panic!("HOLO_KILL_TRIALS={value}: not a number of trials")),
        Err(_) => DEFAULT_TRIALS,
    };
    let started = Instant::now();
    let reference = Reference::run(recipe);
    let mut total = Counts::default();
    let mut failures = Vec::new();
    for index in 0..count {
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| trial(recipe, &reference, index)))
            .unwrap_or_else(|panic| {
                Err(format!(
                    "{} trial {index}: {}",
                    recipe.name,
                    panic_message(&panic)
                ))
            });
        match outcome {
            Ok(counts) => {
                total.kills += counts.kills;
                total.inside_saves += counts.inside_saves;
                total.resumes += counts.resumes;
            }
            Err(message) => failures.push(message),
        }
    }
    eprintln!(
        "kill-trials {}: {count} trials, {} kills ({} inside a checkpoint write), {} resumes, {} failures, {:.0} s",
        recipe.name,
        total.kills,
        total.inside_saves,
        total.resumes,
        failures.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
