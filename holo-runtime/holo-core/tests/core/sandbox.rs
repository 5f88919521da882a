//! The adversarial suite: hostile programs, each run as a model's code turn through the real
//! `CodeExecutor` (a holoware, the interpreter, the sandbox), then a normal turn. Each case asserts that
//! the attack failed, that the rollout got an error (or the harmless result) inside `<output>`, that
//! the host and the run are untouched, and that the next turn runs normally.
//!
//! **A broken sandbox must never take the test machine down.** The cases that would hurt the whole
//! machine if they escaped (signals to every process, process bombs, memory bombs, daemons) first run
//! a harmless probe, from inside the same sandbox with the same limits ([`prove_isolation`]): the code
//! must be PID 2 under the sandbox's init in a fresh PID namespace, see no host process, run as an
//! unprivileged uid without capabilities, and have the limits in force. A failed probe fails the test
//! before the hostile case runs. As root, one unguarded `os.kill(-1, 9)` ends every process of the
//! machine.
//!
//! Where the machine cannot sandbox (no user namespaces), every case fails under `CI=true` and skips
//! elsewhere, saying so (`common::components`).

use std::path::Path;
use std::process::{Child, Command, Stdio};

use holo_core::Resources;
use serde_json::json;

/// The `<output>` texts of a transcript, in order.
fn outputs(transcript: &str) -> Vec<String> {
    transcript
        .split("<output>")
        .skip(1)
        .map(|part| part.split("</output>").next().unwrap_or("").to_string())
        .collect()
}

/// Runs `code` as a code turn of a rollout whose `CodeExecutor` tag has `tag_args`, then a normal turn
/// (`print('next')`); returns what the hostile turn's `<output>` says, after checking the normal turn.
fn attack(code: &str, tag_args: &str) -> String {
    let source = format!(
        "<|o_o|>\nGo.\n<|ToolRunner max_turns=3|>\n    <|@_@:turn stop=\"</code>\"|>\n    <|o_o|>\n    <|CodeExecutor turn {tag_args}|>\n"
    );
    let hostile = format!("<code>\n{code}\n</code>");
    let replies = [
        hostile.as_str(),
        "<code>\nprint('next')\n</code>",
        "<answer>done</answer>",
    ];
    let transcript =
        crate::common::rollout::run(&source, json!({}), &replies, &Resources::default()).unwrap();
    let outputs = outputs(&transcript.to_string());
    assert_eq!(outputs.len(), 2, "{transcript}");
    assert_eq!(
        outputs[1], "next",
        "the turn after the attack did not run normally"
    );
    outputs[0].clone()
}

/// The value after `key ` on its own line of `output`.
fn field<'a>(output: &'a str, key: &str) -> &'a str {
    output
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{key} ")))
        .unwrap_or_else(|| panic!("no `{key}` in the probe's output:\n{output}"))
}

/// Proves, from inside a sandbox with the tag arguments `tag_args`, the isolation that a machine-wide
/// case relies on; panics (failing the test before the case runs) otherwise. `processes` and
/// `memory_mib` are the limits the tag sets (or the defaults).
fn prove_isolation(tag_args: &str, processes: u64, memory_mib: u64) {
    let host_pid = std::process::id();
    let probe = format!(
        r#"import os, resource
print('pid', os.getpid())
print('ppid', os.getppid())
print('uids', os.getuid(), os.geteuid(), os.getgid())
print('pids', ' '.join(sorted(p for p in os.listdir('/proc') if p.isdigit())))
print('nproc', resource.getrlimit(resource.RLIMIT_NPROC)[0])
print('as', resource.getrlimit(resource.RLIMIT_AS)[0] >> 20)
print('hostpid', os.path.exists('/proc/{host_pid}'))
print('project', os.path.exists({project:?}))
print('cap', [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0])"#,
        project = env!("CARGO_MANIFEST_DIR"),
    );
    let output = attack(&probe, tag_args);
    // PID 2 of a fresh PID namespace, under the sandbox's init.
    assert_eq!(field(&output, "pid"), "2", "{output}");
    assert_eq!(field(&output, "ppid"), "1", "{output}");
    // Only itself is visible (init is hidden, no host process).
    assert_eq!(field(&output, "pids"), "2", "{output}");
    if host_pid > 2 {
        assert_eq!(field(&output, "hostpid"), "False", "{output}");
    }
    // An unprivileged user without capabilities.
    assert_eq!(field(&output, "uids"), "1000 1000 1000", "{output}");
    assert_eq!(field(&output, "cap"), "0000000000000000", "{output}");
    // The limits in force.
    assert_eq!(field(&output, "nproc"), processes.to_string(), "{output}");
    assert_eq!(field(&output, "as"), memory_mib.to_string(), "{output}");
    // Nothing of the project.
    assert_eq!(field(&output, "project"), "False", "{output}");
}

/// Host processes whose command line contains `marker`.
fn host_processes_with(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if !name.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
            if String::from_utf8_lossy(&cmdline).contains(marker) {
                found.push(name);
            }
        }
    }
    found
}

/// A host process that must survive the case.
struct Sentinel(Child);

impl Sentinel {
    fn start() -> Self {
        Sentinel(
            Command::new("sleep")
                .arg("600")
                .stdin(Stdio::null())
                .spawn()
                .unwrap(),
        )
    }

    fn assert_alive(&mut self) {
        assert!(
            matches!(self.0.try_wait(), Ok(None)),
            "a host process was killed"
        );
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn marker(case: &str) -> String {
    format!("holo-sandbox-{case}-{}", std::process::id())
}

#[test]
fn signals_to_the_parent_and_the_trainer_reach_nothing() {
    if !crate::common::components::sandbox() {
        return;
    }
    prove_isolation("", 16, 1024);
    let mut sentinel = Sentinel::start();
    let output = attack(
        &format!(
            "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('parent signalled')\ntry:\n    os.kill({}, signal.SIGKILL)\n    print('TRAINER SIGNALLED')\nexcept OSError as error:\n    print('trainer:', type(error).__name__)",
            std::process::id()
        ),
        "",
    );
    // The parent is the sandbox's init, which ignores it; the trainer's pid does not exist in there.
    assert_eq!(
        output, "parent signalled\ntrainer: ProcessLookupError",
        "{output}"
    );
    sentinel.assert_alive();
}

#[test]
fn kill_every_process_kills_only_the_sandbox() {
    if !crate::common::components::sandbox() {
        return;
    }
    prove_isolation("", 16, 1024);
    let mut sentinel = Sentinel::start();
    let output = attack(
        "import os\ntry:\n    os.kill(-1, 9)\n    print('kill -1: sent')\nexcept OSError as error:\n    print('kill -1:', type(error).__name__)\nprint('still here')",
        "",
    );
    // Nothing else is visible to signal: init is protected, the host's processes are not there.
    assert_eq!(output, "kill -1: ProcessLookupError\nstill here");
    sentinel.assert_alive();
}

#[test]
fn killing_the_process_group_ends_only_the_code() {
    if !crate::common::components::sandbox() {
        return;
    }
    prove_isolation("", 16, 1024);
    let mut sentinel = Sentinel::start();
    let output = attack(
        "import os\nprint('before', flush=True)\nos.killpg(0, 9)",
        "",
    );
    assert_eq!(
        output,
        "before\nerror: the code was killed by signal 9 (SIGKILL)"
    );
    sentinel.assert_alive();
}

#[test]
fn a_memory_bomb_hits_the_limit() {
    if !crate::common::components::sandbox() {
        return;
    }
    prove_isolation("memory=256", 16, 256);
    let output = attack(
        "try:\n    x = bytearray(4 * 1024**3)\n    print('ALLOCATED 4 GiB')\nexcept MemoryError:\n    print('4 GiB: MemoryError')\nchunks = []\ntry:\n    while True:\n        chunks.append(bytearray(16 * 1024**2))\nexcept MemoryError:\n    print('stopped below 256 MiB:', len(chunks) * 16 < 256)",
        "memory=256",
    );
    assert_eq!(
        output, "4 GiB: MemoryError\nstopped below 256 MiB: True",
        "{output}"
    );
}

#[test]
fn a_process_bomb_hits_the_limit_and_leaves_nothing() {
    if !crate::common::components::sandbox() {
        return;
    }
    prove_isolation("processes=8", 8, 1024);
    let marker = marker("bomb");
    let output = attack(
        &format!(
            "import os\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n            os.execv('/bin/sleep', [{marker:?}, '600'])\n        n += 1\n    print('FORKED 200')\nexcept OSError as error:\n    print('fork failed after', n, type(error).__name__)"
        ),
        "processes=8",
    );
    let forked: usize = output
        .strip_prefix("fork failed after ")
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{output}"));
    assert!(forked < 8, "{output}");
    assert!(output.ends_with("BlockingIOError"), "{output}");
    // The sleeping children died with the sandbox when the code exited.
    assert_eq!(host_processes_with(&marker), Vec::<String>::new());
}

#[test]
fn a_daemon_does_not_outlive_the_run() {
    if !crate::common::components::sandbox() {
        return;
    }
    prove_isolation("", 16, 1024);
    let marker = marker("daemon");
    let output = attack(
        &format!(
            "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        os.execv('/bin/sleep', [{marker:?}, '600'])\n    os._exit(0)\nos.wait()\nprint('daemon started')"
        ),
        "",
    );
    assert_eq!(output, "daemon started");
    assert_eq!(host_processes_with(&marker), Vec::<String>::new());
}

#[test]
fn disk_and_output_bombs_are_capped() {
    if !crate::common::components::sandbox() {
        return;
    }
    prove_isolation("", 16, 1024);
    let output = attack(
        "try:\n    with open('big', 'wb') as f:\n        for _ in range(1024):\n            f.write(b'0' * 2**20)\n    print('WROTE 1 GiB')\nexcept OSError as error:\n    print('one file:', error.strerror)\nn = 0\ntry:\n    for i in range(100):\n        with open(f'f{i}', 'wb') as f:\n            f.write(b'0' * 8 * 2**20)\n        n += 1\n    print('WROTE 800 MiB')\nexcept OSError as error:\n    print('many files:', error.strerror, n < 8)",
        "",
    );
    assert_eq!(
        output, "one file: File too large\nmany files: No space left on device True",
        "{output}"
    );
    let output = attack(
        "import sys\nfor _ in range(1600):\n    sys.stdout.write('x' * 65536)",
        "max_output=1000",
    );
    assert!(
        output.starts_with(&"x".repeat(1000))
            && output.ends_with("[output truncated: 104856600 more bytes]"),
        "{}",
        &output[output.len().saturating_sub(100)..]
    );
}

#[test]
fn files_outside_the_work_folder_are_out_of_reach() {
    if !crate::common::components::sandbox() {
        return;
    }
    let run = crate::common::tempdir::Dir::new("sandbox-run");
    let checkpoint = run.path().join("checkpoint.safetensors");
    std::fs::write(&checkpoint, "weights").unwrap();
    let project = Path::new(env!("CARGO_MANIFEST_DIR"));
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let targets = [
        checkpoint.display().to_string(),
        project.join("Cargo.toml").display().to_string(),
    ];
    let folders = [
        run.path().display().to_string(),
        project.display().to_string(),
        home.clone(),
        std::env::temp_dir().display().to_string(),
    ];
    let escaped = marker("escaped");
    let code = format!(
        r#"import os
for path in {targets:?}:
    for name, action in [('remove', lambda: os.remove(path)), ('rename', lambda: os.rename(path, path + '.moved')), ('write', lambda: open(path, 'a').write('pwned'))]:
        try:
            action()
            print(name, path, 'DONE')
        except OSError as error:
            print(name, type(error).__name__)
for folder in {folders:?}:
    for name, action in [('create', lambda: open(os.path.join(folder, {escaped:?}), 'w').write('x')), ('link', lambda: os.symlink('/etc/passwd', os.path.join(folder, {escaped:?} + '.link')))]:
        try:
            action()
            print(name, folder, 'DONE')
        except OSError as error:
            print(name, type(error).__name__)"#
    );
    let output = attack(&code, "");
    // The run folder and the project do not exist in there; the home folder is an empty read-only
    // folder of the sandbox's root (when it is on the way to the interpreter) or missing; /tmp is the
    // sandbox's own work folder, so writing there succeeds without touching the host's.
    let tmp = std::env::temp_dir().display().to_string();
    let outside = output
        .replace(&format!("create {tmp} DONE"), "")
        .replace(&format!("link {tmp} DONE"), "");
    assert!(!outside.contains("DONE"), "{output}");
    assert!(
        output.matches("FileNotFoundError").count() >= 10,
        "{output}"
    );
    assert_eq!(std::fs::read_to_string(&checkpoint).unwrap(), "weights");
    assert_eq!(std::fs::read_dir(run.path()).unwrap().count(), 1);
    for folder in &folders {
        let path = Path::new(folder).join(&escaped);
        assert!(!path.exists(), "{path:?}");
        let link = Path::new(folder).join(format!("{escaped}.link"));
        assert!(std::fs::symlink_metadata(&link).is_err(), "{link:?}");
    }
    assert!(project.join("Cargo.toml").is_file());
}

#[test]
fn secrets_of_the_trainer_and_the_host_are_unreadable() {
    if !crate::common::components::sandbox() {
        return;
    }
    let secret = "sk-holo-sandbox-test-secret";
    std::env::set_var("HOLO_SANDBOX_TEST_API_KEY", secret);
    let exe = std::env::current_exe().unwrap().display().to_string();
    let code = r#"import glob, os
for path in sorted(glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline') + ['/proc/1/environ', '/proc/1/cmdline', '/proc/1/mem']):
    try:
        print(path, open(path, 'rb').read()[:4000])
    except OSError as error:
        print(path, type(error).__name__)
for path in ['/etc/shadow', '/root/.ssh', '/root', '/home', os.path.expanduser('~/.ssh'), '/etc/hostname', '/sys']:
    try:
        print(path, os.listdir(path) if os.path.isdir(path) else open(path).read()[:200])
    except OSError as error:
        print(path, type(error).__name__)
print(sorted(os.environ))"#;
    let output = attack(code, "max_output=65536");
    assert!(!output.contains(secret), "{output}");
    assert!(!output.contains(&exe), "{output}");
    assert!(!output.contains("HOLO_SANDBOX_TEST_API_KEY"), "{output}");
    for missing in [
        "/etc/shadow",
        "/root/.ssh",
        "/proc/1/environ",
        "/proc/1/cmdline",
    ] {
        assert!(
            output.contains(&format!("{missing} FileNotFoundError")),
            "{missing}: {output}"
        );
    }
    assert!(
        output.contains("\n['HOME', 'LANG', 'PATH', 'TMPDIR']"),
        "{output}"
    );
}

#[test]
fn sockets_reach_no_address() {
    if !crate::common::components::sandbox() {
        return;
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let code = format!(
        r#"import socket
for host, port in [('127.0.0.1', {port}), ('1.1.1.1', 80), ('::1', {port})]:
    try:
        s = socket.create_connection((host, port), timeout=3)
        print(host, 'CONNECTED')
    except OSError as error:
        print(host, type(error).__name__)
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))
    print('udp SENT')
except OSError as error:
    print('udp', type(error).__name__)"#
    );
    let output = attack(&code, "");
    assert!(
        !output.contains("CONNECTED") && !output.contains("SENT"),
        "{output}"
    );
    assert_eq!(output.lines().count(), 4, "{output}");
    assert!(matches!(
        listener.accept(),
        Err(error) if error.kind() == std::io::ErrorKind::WouldBlock
    ));
}

#[test]
fn cpu_burners_are_stopped_by_the_timeout_and_the_cpu_limit() {
    if !crate::common::components::sandbox() {
        return;
    }
    let output = attack(
        "print('spinning', flush=True)\nwhile True:\n    pass",
        "timeout=1",
    );
    assert_eq!(
        output,
        "spinning\nerror: the code timed out after 1 s and was stopped"
    );
    let output = attack("while True:\n    pass", "cpu_seconds=1 timeout=60");
    assert_eq!(
        output,
        "error: the code was killed by signal 24 (SIGXCPU: it used up its CPU time)"
    );
}

#[test]
fn file_descriptors_are_capped() {
    if !crate::common::components::sandbox() {
        return;
    }
    let output = attack(
        "import os\nfds = []\ntry:\n    while True:\n        fds.append(os.open('/dev/null', os.O_RDONLY))\nexcept OSError as error:\n    print(len(fds) < 64, error.strerror)",
        "open_files=64",
    );
    assert_eq!(output, "True Too many open files");
}

#[test]
fn chroot_unshare_mount_and_ptrace_are_denied() {
    if !crate::common::components::sandbox() {
        return;
    }
    let code = r#"import ctypes, os, subprocess
try:
    os.chroot('/tmp')
    print('chroot DONE')
except OSError as error:
    print('chroot', error.strerror)
for command in (['unshare', '-r', 'true'], ['unshare', '-Urm', 'true'], ['mount', '-t', 'tmpfs', 'x', '/tmp']):
    print(command[0], subprocess.run(command, capture_output=True).returncode != 0)
libc = ctypes.CDLL(None, use_errno=True)
for name, call in [('unshare', lambda: libc.unshare(0x10000000)), ('mount', lambda: libc.mount(b'x', b'/tmp', b'tmpfs', 0, None)), ('ptrace', lambda: libc.ptrace(16, os.getpid(), 0, 0)), ('setuid', lambda: libc.setuid(0))]:
    print(name, call(), os.strerror(ctypes.get_errno()))"#;
    let output = attack(code, "");
    assert_eq!(
        output,
        "chroot Operation not permitted\nunshare True\nunshare True\nmount True\nunshare -1 Operation not permitted\nmount -1 Operation not permitted\nptrace -1 Operation not permitted\nsetuid -1 Invalid argument",
        "{output}"
    );
}
