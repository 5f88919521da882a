//! The trainer survives hostile rollouts: `holo train` over an environment whose every rollout runs a
//! hostile program (kill the trainer, kill every process, delete the checkpoints, a process bomb, a
//! daemon, an infinite loop) completes all its steps, keeps its checkpoints, and reports the failures
//! as `tools/failed` and `tools/timed_out`.
//!
//! Like holo-core's tests/core/sandbox.rs, the machine-wide programs run only after a harmless probe
//! through the same `run_python` path proved the isolation (own PID namespace, unprivileged uid, limits in force).

use std::time::Duration;

use crate::common::{holo_command, repo, run_metrics};
use holo_runtime::holotypes::{run_python, Outcome, PythonConfig};
use holo_runtime::sandbox::Limits;

#[test]
fn a_run_full_of_hostile_programs_completes() {
    if !crate::common::components::sandbox() {
        return;
    }
    // The probe, with hostile.hol's process and memory limits.
    let config = PythonConfig {
        limits: Limits {
            timeout: Duration::from_secs(10),
            processes: 8,
            memory: 256 << 20,
            ..Limits::default()
        },
        ..PythonConfig::default()
    };
    let probe = run_python(
        "import os, resource\nprint(os.getpid(), os.getppid(), os.getuid(), sorted(p for p in os.listdir('/proc') if p.isdigit()), resource.getrlimit(resource.RLIMIT_NPROC)[0], resource.getrlimit(resource.RLIMIT_AS)[0] >> 20)",
        &config,
    );
    assert_eq!(probe.outcome, Outcome::Exited(0), "{probe:?}");
    assert_eq!(
        probe.output, "2 1 1000 ['2'] 8 256\n",
        "isolation not proven: {probe:?}"
    );

    let run = crate::common::tempdir::Dir::new("hostile-train");
    let out = run.path().join("run");
    let marker = format!("holo-hostile-train-{}", std::process::id());
    // 3 steps of 2 rows use rows 0 to 5 (no shuffling): every program runs. (Killing the parent is
    // holo-core's tests/core/sandbox.rs's.)
    let programs = [
        "x = bytearray(1 << 33)".to_string(),
        "import os\nos.kill(-1, 9)".to_string(),
        format!(
            "import shutil\nshutil.rmtree({:?})",
            out.display().to_string()
        ),
        "import os\nwhile True:\n    os.fork()".to_string(),
        format!(
            "import os\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', [{marker:?}, '600'])\nprint('daemon')"
        ),
        "while True:\n    pass".to_string(),
    ];
    let rows: String = programs
        .iter()
        .map(|program| {
            serde_json::json!({"question": "What is 6*7?", "program": format!("<code>{program}</code>")})
                .to_string()
                + "\n"
        })
        .collect();
    let data = run.path().join("rows.jsonl");
    std::fs::write(&data, rows).unwrap();
    let fixtures = repo().join("holo-runtime/tests/fixtures");
    let output = holo_command(&[
        "train",
        fixtures.join("train/hostile.hol").to_str().unwrap(),
        "--model",
        fixtures.join("models/qwen2").to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--max-steps",
        "3",
        "--num-generations",
        "4",
        "--per-device-train-batch-size",
        "8",
        "--max-completion-length",
        "8",
        "--save-steps",
        "1",
        "--shuffle-dataset",
        "false",
    ])
    .output()
    .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metrics = run_metrics(&out);
    assert_eq!(metrics.len(), 3, "{metrics:?}");
    for step in 1..=3 {
        assert!(
            out.join(format!("checkpoint-{step}")).is_dir(),
            "checkpoint-{step} lost"
        );
    }
    let total = |key: &str| -> f64 {
        metrics
            .iter()
            .map(|m| {
                m.get(key)
                    .and_then(serde_json::Value::as_f64)
                    .unwrap_or(0.0)
            })
            .sum()
    };
    // 3 steps x 8 rollouts, each running its row's program once.
    assert_eq!(total("tools/calls"), 24.0, "{metrics:?}");
    assert!(total("tools/failed") >= 12.0, "{metrics:?}");
    assert!(total("tools/timed_out") >= 3.0, "{metrics:?}");
    let leftovers: Vec<_> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|entry| {
            std::fs::read(entry.path().join("cmdline"))
                .is_ok_and(|cmdline| String::from_utf8_lossy(&cmdline).contains(&marker))
        })
        .collect();
    assert!(
        leftovers.is_empty(),
        "daemons outlived the run: {leftovers:?}"
    );
}
