//! `CodeExecutor` and `run_python` against the real `python3` of the machine: output, exceptions,
//! timeouts, a fresh work folder per run, no network, output caps, and `hol/codemath.hol` end to end;
//! and the unsandboxed path (`run_python_unsandboxed`: temporary directories, process-group kills).
//! What the sandbox stops is in `tests/core/sandbox.rs`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use holo_core::holotypes::{
    self, network_isolation, run_python, run_python_unsandboxed, Outcome, PythonConfig,
};
use holo_core::interpreter::{Holoware, Row};
use holo_core::sandbox::Limits;
use holo_core::{Resources, Transcript};

use crate::common::components::Component;
use serde_json::json;

fn config(timeout_secs: f64) -> PythonConfig {
    PythonConfig {
        limits: Limits {
            timeout: Duration::from_secs_f64(timeout_secs),
            ..Limits::default()
        },
        ..PythonConfig::default()
    }
}

fn python(code: &str) -> holo_core::holotypes::Execution {
    run_python(code, &config(20.0))
}

/// Runs `source` with the built-ins and scripted replies; the transcript.
fn run(source: &str, replies: &[&str]) -> Transcript {
    let row = json!({"query": "What is 17 * 23?", "expected": "391"});
    crate::common::rollout::run(source, row, replies, &Resources::default()).unwrap()
}

const LOOP: &str = "<|o_o|>\n<|query|>\n<|ToolRunner max_turns=3|>\n    <|@_@:turn stop=\"</code>\"|>\n    <|o_o|>\n    <|CodeExecutor turn timeout=20|>\n<|MathAnswer var=turn|>\n";

#[test]
fn runs_the_code_of_the_turn_and_writes_its_output() {
    let transcript = run(
        LOOP,
        &[
            "<reasoning>Multiply.</reasoning>\n<code>\nx = 17 * 23\nprint(x)\n</code>",
            "<answer>391</answer>",
        ],
    );
    let text = transcript.to_string();
    assert!(text.contains("--- user\n<output>391</output>\n"), "{text}");
    assert_eq!(transcript.reward(), 1.0, "{text}");
}

#[test]
fn an_exception_is_reported_to_the_model() {
    let transcript = run(
        LOOP,
        &[
            "<code>print('before')\n1 / 0</code>",
            "<answer>391</answer>",
        ],
    );
    let text = transcript.to_string();
    assert!(text.contains("<output>before\nTraceback"), "{text}");
    assert!(
        text.contains("ZeroDivisionError: division by zero</output>"),
        "{text}"
    );
}

#[test]
fn a_turn_without_code_or_with_an_answer() {
    let transcript = run(LOOP, &["I will just think.", "<answer>391</answer>"]);
    let text = transcript.to_string();
    assert!(
        text.contains(
            "<output>error: no <code> block found; write Python inside <code>...</code></output>"
        ),
        "{text}"
    );
    // The answer ends the loop: no <output> after it.
    assert_eq!(text.matches("<output>").count(), 1, "{text}");
}

#[test]
fn markdown_fences_inside_the_block_are_removed() {
    let transcript = run(
        LOOP,
        &[
            "<code>\n```python\nprint(2 ** 10)\n```\n</code>",
            "<answer>1024</answer>",
        ],
    );
    assert!(
        transcript.to_string().contains("<output>1024</output>"),
        "{transcript}"
    );
}

#[test]
fn an_infinite_loop_is_killed_at_the_timeout() {
    let started = Instant::now();
    let execution = run_python(
        "import sys\nprint('started', flush=True)\nwhile True:\n    pass\n",
        &config(1.0),
    );
    let elapsed = started.elapsed();
    assert_eq!(execution.outcome, Outcome::TimedOut);
    assert_eq!(execution.output, "started\n");
    // Not a timing assertion: an infinite loop never ends on its own, so any bound shows the kill.
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
    assert_eq!(
        execution.message(Duration::from_secs(1)),
        "started\nerror: the code timed out after 1 s and was stopped"
    );
}

#[cfg(target_os = "linux")]
#[test]
fn the_unsandboxed_timeout_kills_what_the_code_started() {
    let execution = run_python_unsandboxed(
        "import subprocess\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid, flush=True)\nwhile True:\n    pass\n",
        &config(1.5),
    );
    assert_eq!(execution.outcome, Outcome::TimedOut);
    let pid: u32 = execution.output.trim().parse().expect("the child's pid");
    // The group was killed with SIGKILL; the orphan is reaped by init shortly after.
    let gone = (0..100).any(|_| {
        let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|stat| !stat.contains(") Z "));
        if alive {
            std::thread::sleep(Duration::from_millis(50));
        }
        !alive
    });
    assert!(gone, "process {pid} (sleep 60) survived the timeout");
}

#[test]
fn each_run_has_its_own_work_folder() {
    if !crate::common::components::sandbox() {
        return;
    }
    let first = python(
        "import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())\nprint(os.environ['HOME'] == os.getcwd())\nprint(sorted(os.listdir('.')))",
    );
    assert!(first.sandboxed, "{first:?}");
    assert_eq!(first.output, "/tmp\nTrue\n['scratch.txt']\n", "{first:?}");
    let second = python("import os\nprint(os.listdir('.'))");
    assert_eq!(second.output, "[]\n", "the file of the first run persisted");
}

#[test]
fn each_unsandboxed_run_has_its_own_temporary_directory() {
    let python = |code: &str| run_python_unsandboxed(code, &config(20.0));
    let first = python(
        "import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())\nprint(os.environ['HOME'] == os.getcwd())\nprint(sorted(os.listdir('.')))",
    );
    assert_eq!(first.outcome, Outcome::Exited(0), "{first:?}");
    let lines: Vec<&str> = first.output.lines().collect();
    let dir = PathBuf::from(lines[0]);
    assert_eq!(lines[1..], ["True", "['scratch.txt']"], "{first:?}");
    assert!(
        dir.starts_with(std::env::temp_dir().canonicalize().unwrap())
            || dir.starts_with(std::env::temp_dir()),
        "{dir:?}"
    );
    assert!(!dir.exists(), "{dir:?} was not removed");

    let second = python("import os\nprint(os.getcwd())\nprint(os.listdir('.'))");
    let lines: Vec<&str> = second.output.lines().collect();
    assert_ne!(lines[0], dir.to_str().unwrap());
    assert_eq!(lines[1], "[]", "the file of the first run persisted");
}

#[test]
fn an_unsandboxed_read_only_tree_is_still_removed() {
    let execution = run_python_unsandboxed(
        "import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a/b', 0o500)\nos.chmod('a', 0o500)\nprint(os.getcwd())",
        &config(20.0),
    );
    let dir = PathBuf::from(execution.output.trim());
    assert!(dir.is_absolute(), "{execution:?}");
    assert!(!dir.exists(), "{dir:?} was not removed");
}

#[test]
fn the_environment_is_cleared() {
    std::env::set_var("HOLO_SECRET_FOR_TEST", "leak");
    let execution = python(
        "import os\nprint(sorted(os.environ))\nprint(os.environ['HOME'] == os.environ['TMPDIR'] == os.getcwd())",
    );
    let lines: Vec<&str> = execution.output.lines().collect();
    assert_eq!(lines[1], "True", "{execution:?}");
    // Only PATH, HOME and TMPDIR are passed; a launcher such as a pyenv shim may add its own variables,
    // but nothing of this process's environment leaks.
    for name in ["HOME", "PATH", "TMPDIR"] {
        assert!(lines[0].contains(&format!("'{name}'")), "{execution:?}");
    }
    for leaked in [
        "HOLO_SECRET_FOR_TEST",
        "CARGO_PKG_NAME",
        "CARGO_MANIFEST_DIR",
    ] {
        assert!(!lines[0].contains(leaked), "{leaked}: {execution:?}");
    }
}

#[test]
fn the_network_is_unreachable_when_isolation_works() {
    if !network_isolation() {
        Component::Sandbox.missing(
            "`unshare -rn` does not work on this machine, so CodeExecutor runs code with the host's network",
        );
        return;
    }
    let execution = python(
        "import socket\nprint([name for _, name in socket.if_nameindex()])\ns = socket.socket()\ns.settimeout(3)\ntry:\n    s.connect(('1.1.1.1', 80))\n    print('connected')\nexcept OSError as error:\n    print('blocked', error.errno)\n",
    );
    assert!(execution.network_isolated);
    let lines: Vec<&str> = execution.output.lines().collect();
    assert_eq!(lines[0], "['lo']", "{execution:?}");
    assert!(lines[1].starts_with("blocked"), "{execution:?}");
}

#[test]
fn huge_output_is_truncated() {
    let execution = run_python(
        "print('x' * 1_000_000)\nimport sys\nprint('tail', file=sys.stderr)",
        &PythonConfig {
            max_output: 1000,
            ..config(20.0)
        },
    );
    assert_eq!(execution.outcome, Outcome::Exited(0));
    assert_eq!(execution.output.len(), 1000);
    // 1,000,001 bytes of stdout and 5 of stderr; 1000 kept.
    assert_eq!(execution.truncated, 1_000_006 - 1000);
    let message = execution.message(Duration::from_secs(20));
    assert!(
        message.ends_with("\n[output truncated: 999006 more bytes]"),
        "{}",
        &message[message.len() - 60..]
    );
}

#[test]
fn unicode_output_and_an_exit_status() {
    let execution = python("print('π ≈ 3.14159')\nraise SystemExit(3)");
    assert_eq!(execution.outcome, Outcome::Exited(3));
    assert_eq!(
        execution.message(Duration::from_secs(1)),
        "π ≈ 3.14159\nerror: the code exited with status 3"
    );
}

#[test]
fn a_missing_interpreter_is_a_message_not_a_panic() {
    for python in ["/nonexistent/python3", "no-such-python-interpreter"] {
        let execution = run_python(
            "print(1)",
            &PythonConfig {
                python: python.to_string(),
                ..PythonConfig::default()
            },
        );
        assert!(
            matches!(&execution.outcome, Outcome::Failed(message) if message.contains("was not found")),
            "{execution:?}"
        );
        assert!(execution
            .message(Duration::from_secs(1))
            .starts_with("error: cannot run Python"));
    }
    let transcript = run(
        "<|o_o|>\n<|query|>\n<|@_@:turn|>\n<|o_o|>\n<|CodeExecutor turn python=\"/nonexistent/python3\"|>\n",
        &["<code>print(1)</code>"],
    );
    assert!(
        transcript.to_string().contains(
            "<output>error: cannot run Python: `/nonexistent/python3` was not found</output>"
        ),
        "{transcript}"
    );
}

#[test]
fn bad_arguments_fail_the_machine() {
    for (tag, message) in [
        ("<|CodeExecutor turn timeout=0|>", "timeout must be"),
        ("<|CodeExecutor turn timeout=fast|>", "must be a number"),
        (
            "<|CodeExecutor turn max_output=0|>",
            "max_output must be at least 1",
        ),
    ] {
        let source = format!("<|o_o|>\nx\n<|@_@:turn|>\n{tag}\n");
        let holoware = Arc::new(
            Holoware::load(
                "test.hol",
                source.as_bytes(),
                Arc::new(holotypes::registry()),
            )
            .unwrap(),
        );
        let error = match holoware.start_with(&Row::new(), &Resources::default()) {
            Ok(_) => panic!("{tag} built"),
            Err(error) => error,
        };
        assert!(error.to_string().contains(message), "{tag}: {error}");
    }
}

#[test]
fn codemath_runs_with_the_builtins() {
    let path = crate::common::repo().join("hol/codemath.hol");
    let source = std::fs::read_to_string(path).unwrap();
    let transcript = run(
        &source,
        &[
            "<reasoning>2^10</reasoning>\n<code>\nprint(2 ** 10)\n</code>",
            "<answer>1024</answer>",
        ],
    );
    let text = transcript.to_string();
    assert!(
        text.contains("--- user\n<output>1024</output>\n--- assistant\n⟦<answer>1024</answer>⟧"),
        "{text}"
    );
}
