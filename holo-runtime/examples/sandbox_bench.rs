//! The sandbox's cost per run: `print(1)` in Python, start to exit, through the sandbox
//! (`run_python`) against today's unsandboxed path under `unshare -rn` (`run_python_unsandboxed`) and
//! a bare `python3 -I -`; then runs per second with every core busy. Run by `benches/sandbox.sh`.

use std::time::{Duration, Instant};

use holo_runtime::holotypes::{run_python, run_python_unsandboxed, Outcome, PythonConfig};

fn mean_time(runs: usize, mut run: impl FnMut()) -> Duration {
    run(); // warm-up: the interpreter's files in the page cache, the sandbox's probe done
    let started = Instant::now();
    for _ in 0..runs {
        run();
    }
    started.elapsed() / runs as u32
}

fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(50);
    if let Err(reason) = holo_runtime::sandbox::available() {
        eprintln!("this machine cannot sandbox: {reason}");
        std::process::exit(1);
    }
    // The real interpreter, not a launcher such as a pyenv shim (which costs ~70 ms a run by itself):
    // every path runs the same executable.
    let located = std::process::Command::new("python3")
        .args([
            "-I",
            "-c",
            "import os, sys; print(os.path.realpath(sys.executable))",
        ])
        .output()
        .expect("python3 runs");
    let python = String::from_utf8_lossy(&located.stdout).trim().to_string();
    let config = PythonConfig {
        python: python.clone(),
        ..PythonConfig::default()
    };
    let check = |outcome: &Outcome, output: &str| {
        assert!(
            *outcome == Outcome::Exited(0) && output == "1\n",
            "{outcome:?} {output:?}"
        )
    };
    let bare = mean_time(runs, || {
        let output = std::process::Command::new(&python)
            .args(["-I", "-c", "print(1)"])
            .output()
            .unwrap();
        assert_eq!(output.stdout, b"1\n");
    });
    let unshare = mean_time(runs, || {
        let execution = run_python_unsandboxed("print(1)", &config);
        check(&execution.outcome, &execution.output);
    });
    let sandboxed = mean_time(runs, || {
        let execution = run_python("print(1)", &config);
        assert!(execution.sandboxed);
        check(&execution.outcome, &execution.output);
    });
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                for _ in 0..runs {
                    let execution = run_python("print(1)", &config);
                    check(&execution.outcome, &execution.output);
                }
            });
        }
    });
    let per_second = (threads * runs) as f64 / started.elapsed().as_secs_f64();
    let ms = |duration: Duration| duration.as_secs_f64() * 1000.0;
    println!("print(1) in Python ({python}), start to exit, mean of {runs} runs:");
    println!("  bare interpreter             {:7.1} ms", ms(bare));
    println!("  unshare -rn (unsandboxed)    {:7.1} ms", ms(unshare));
    println!("  sandbox                      {:7.1} ms", ms(sandboxed));
    println!(
        "  sandbox overhead vs unshare  {:+7.1} ms per run (target <= 20 ms)",
        ms(sandboxed) - ms(unshare)
    );
    println!("sandboxed runs per second on {threads} threads: {per_second:.1}");
}
