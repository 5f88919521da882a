//! Code execution as a tool: [`CodeExecutor`] runs the Python code of the model's turn in the
//! [sandbox](crate::sandbox) ([`run_python`]) and writes what it printed inside `<output>` tags.
//!
//! How code runs is described on [`CodeExecutor`].

use std::collections::HashMap;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::Duration;

use holoc::ir::Program;

use crate::holotype::{Args, Cx, Enter, Holotype, HolotypeError};
use crate::holotypes::stats::ToolStats;
use crate::holotypes::tools::last_tag;
use crate::resources::Resources;
use crate::sandbox::{self, Capture, Limits};
#[cfg(target_os = "linux")]
use crate::sandbox::{Job, Sandbox, Status};

/// How [`run_python`] runs code.
#[derive(Debug, Clone, PartialEq)]
pub struct PythonConfig {
    /// The interpreter: a name looked up in `PATH`, or a path (default `python3`).
    pub python: String,
    /// Bytes of output kept, stdout and stderr together (default 4096).
    pub max_output: usize,
    /// The sandbox's limits, the wall-clock timeout among them (default 5 s).
    pub limits: Limits,
    /// Run the code without the sandbox where this machine cannot sandbox (default: refuse).
    pub allow_unsandboxed: bool,
}

impl Default for PythonConfig {
    fn default() -> Self {
        PythonConfig {
            python: "python3".to_string(),
            max_output: 4096,
            limits: Limits::default(),
            allow_unsandboxed: false,
        }
    }
}

/// How the driver (`holo`, a trainer) wants model-written code run: the sandbox's limits, and whether
/// code may run unsandboxed where the machine cannot sandbox. Put it in the [`Resources`] of the
/// rollouts; a `CodeExecutor` tag's own arguments override these limits. Without it, the defaults:
/// [`Limits::default`], and refuse to run unsandboxed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CodeSandbox {
    pub limits: Limits,
    pub allow_unsandboxed: bool,
}

impl CodeSandbox {
    /// `Ok` when code can run here: in the sandbox, or unsandboxed because that was allowed. The error
    /// says what the machine lacks and names the opt-out.
    pub fn check(&self) -> Result<(), String> {
        match sandbox::available() {
            Ok(()) => Ok(()),
            Err(_) if self.allow_unsandboxed => Ok(()),
            Err(reason) => Err(refusal(reason)),
        }
    }
}

/// The error for code that is not run because the machine cannot sandbox it.
fn refusal(reason: &str) -> String {
    format!(
        "CodeExecutor runs model-written code only in a sandbox, and this machine cannot sandbox: \
         {reason}. To run the code without one (it can then read, change and delete whatever this \
         user can, kill this process and reach the network), pass --allow-unsandboxed-code \
         (library: `CodeSandbox {{ allow_unsandboxed: true, .. }}` in the Resources)"
    )
}

/// Checks, before a run starts, that the code of `program`'s `CodeExecutor` tags (the built-in) can
/// run with the [`CodeSandbox`] of `resources` (the default without one); `Ok` when it has none.
pub fn check_code_sandbox(program: &Program, resources: &Resources) -> Result<(), String> {
    if !program
        .holotypes
        .iter()
        .any(|holotype| holotype.builtin && holotype.name == "CodeExecutor")
    {
        return Ok(());
    }
    resources.get::<CodeSandbox>().unwrap_or_default().check()
}

/// The seconds of `duration` for messages: `5 s`, `1.5 s`.
fn seconds(duration: Duration) -> String {
    let secs = duration.as_secs_f64();
    if secs.fract() == 0.0 {
        format!("{secs:.0} s")
    } else {
        format!("{secs} s")
    }
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The process exited with this status code (0 is success).
    Exited(i32),
    /// The process was ended by this signal.
    Signal(i32),
    /// The timeout passed; the process group was killed.
    TimedOut,
    /// The code could not be run (no interpreter, no temporary directory); the message says why.
    Failed(String),
}

/// What a run of [`run_python`] produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Execution {
    /// Stdout then stderr, as text (invalid UTF-8 replaced), at most `max_output` bytes.
    pub output: String,
    /// Bytes of output dropped beyond `max_output`.
    pub truncated: usize,
    /// Bytes the code wrote to stderr (kept or not).
    pub stderr_bytes: usize,
    pub outcome: Outcome,
    /// Whether the code ran without network access (in the sandbox, or under `unshare -rn`).
    pub network_isolated: bool,
    /// Whether the code ran in the [sandbox](crate::sandbox).
    pub sandboxed: bool,
}

impl Execution {
    /// The text shown to the model: the output without trailing whitespace, a note when it was cut, and
    /// a line `error: ...` for a timeout, a signal, a non-zero exit without output on stderr, or a run
    /// that could not start. `(no output)` when there is nothing else to say.
    pub fn message(&self, timeout: Duration) -> String {
        let mut text = self.output.trim_end().to_string();
        let mut note = |line: String| {
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&line);
        };
        if self.truncated > 0 {
            note(format!("[output truncated: {} more bytes]", self.truncated));
        }
        match &self.outcome {
            Outcome::Exited(0) => {}
            // A traceback on stderr already says what went wrong.
            Outcome::Exited(code) if self.stderr_bytes == 0 => {
                note(format!("error: the code exited with status {code}"))
            }
            Outcome::Exited(_) => {}
            Outcome::Signal(signal) => note(format!(
                "error: the code was killed by signal {signal}{}",
                signal_meaning(*signal)
            )),
            Outcome::TimedOut => note(format!(
                "error: the code timed out after {} and was stopped",
                seconds(timeout)
            )),
            Outcome::Failed(message) => note(format!("error: {message}")),
        }
        if text.is_empty() {
            text.push_str("(no output)");
        }
        text
    }
}

/// Why a sandboxed program usually gets `signal`, for the model's message.
fn signal_meaning(signal: i32) -> &'static str {
    #[cfg(unix)]
    {
        match signal {
            libc::SIGKILL => " (SIGKILL)",
            libc::SIGXCPU => " (SIGXCPU: it used up its CPU time)",
            libc::SIGXFSZ => " (SIGXFSZ: it wrote a file past the size limit)",
            libc::SIGSEGV => " (SIGSEGV)",
            libc::SIGSYS => " (SIGSYS: a forbidden system call)",
            _ => "",
        }
    }
    #[cfg(not(unix))]
    {
        let _ = signal;
        ""
    }
}

/// `<|CodeExecutor turn|>`: runs the Python code of the last `<code>...</code>` block of the variable
/// `turn` (an unclosed last block runs to the end of the turn; a Markdown fence inside the block is
/// removed) and writes `<output>...</output>`. When the turn holds an answer (`answer=` tag, default
/// `answer`) nothing runs and its body, if any, is skipped. Parameters: `timeout` (seconds, default 5),
/// `python` (the interpreter, default `python3`), `max_output` (bytes, default 4096), and the
/// sandbox's limits: `memory` (MiB of address space per process, default 1024), `processes` (16),
/// `cpu_seconds` (10), `file_size` (MiB, 16), `open_files` (256), `work_size` (MiB, 64). Defaults
/// come from the [`CodeSandbox`] resource when the driver gives one (`[sandbox]` of a training
/// configuration); the tag's arguments override it. Everything that goes wrong (no code, an
/// exception, a timeout, a limit, no interpreter) is written to the model inside `<output>`.
///
/// # How code runs
///
/// In the [sandbox](crate::sandbox) ([`run_python`]): a new user, PID, mount, network, IPC and UTS
/// namespace; an unprivileged uid without capabilities; a read-only view of the system folders and of
/// the interpreter's prefix, nothing else of the host; a writable work folder `/tmp` (its working
/// directory, `HOME` and `TMPDIR`) capped in size and gone after the run; resource limits and a
/// seccomp filter; every process it started killed when it ends. The interpreter runs as
/// `python3 -I -X utf8 -` (isolated mode, the code read from stdin) with only `PATH`, `HOME`,
/// `TMPDIR` and `LANG` set.
///
/// Where the machine cannot sandbox (not Linux, user namespaces disabled), the holotype refuses to
/// be built, naming what is missing, unless the driver allows unsandboxed code
/// (`--allow-unsandboxed-code`, [`CodeSandbox::allow_unsandboxed`]). Unsandboxed code runs as before
/// the sandbox existed: a temporary folder, a process group killed at the timeout, no network under
/// `unshare -rn` where that works, and otherwise the current user's rights.
///
/// With a [`ToolStats`] resource, every run is counted there (calls, failures, timeouts).
pub struct CodeExecutor {
    variable: String,
    answer: String,
    config: PythonConfig,
    stats: Option<Arc<ToolStats>>,
}

impl Holotype for CodeExecutor {
    /// The code runs in a process, for up to its timeout.
    const BLOCKS: bool = true;
    const PARAMS: &'static [&'static str] = &[
        "timeout",
        "python",
        "max_output",
        "answer",
        "memory",
        "processes",
        "cpu_seconds",
        "file_size",
        "open_files",
        "work_size",
    ];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        let policy = args
            .resources
            .get::<CodeSandbox>()
            .map(|policy| (*policy).clone())
            .unwrap_or_default();
        let mut config = PythonConfig {
            limits: policy.limits.clone(),
            allow_unsandboxed: policy.allow_unsandboxed,
            ..PythonConfig::default()
        };
        if let Some(timeout) = args.float("timeout")? {
            if !(timeout > 0.0 && timeout <= 86_400.0) {
                return Err(HolotypeError::new(format!(
                    "timeout must be a number of seconds above 0 (at most 86400), found {timeout}"
                )));
            }
            config.limits.timeout = Duration::from_secs_f64(timeout);
        }
        if let Some(python) = args.name("python")? {
            config.python = python.to_string();
        }
        if let Some(max_output) = args.count("max_output")? {
            if max_output == 0 {
                return Err(HolotypeError::new("max_output must be at least 1"));
            }
            config.max_output = max_output as usize;
        }
        const MIB: u64 = 1 << 20;
        let limits = &mut config.limits;
        for (name, field, unit) in [
            ("memory", &mut limits.memory, MIB),
            ("processes", &mut limits.processes, 1),
            ("cpu_seconds", &mut limits.cpu_seconds, 1),
            ("file_size", &mut limits.file_size, MIB),
            ("open_files", &mut limits.open_files, 1),
            ("work_size", &mut limits.work_size, MIB),
        ] {
            if let Some(value) = args.count(name)? {
                *field = u64::from(value) * unit;
            }
        }
        limits.validate().map_err(HolotypeError::new)?;
        policy.check().map_err(HolotypeError::new)?;
        Ok(CodeExecutor {
            variable: args
                .positional_name("CodeExecutor")?
                .unwrap_or("turn")
                .to_string(),
            answer: args.name("answer")?.unwrap_or("answer").to_string(),
            config,
            stats: args.resources.get::<ToolStats>(),
        })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        let turn = cx.var(&self.variable).unwrap_or_default();
        if turn.contains(&format!("<{}>", self.answer)) {
            return Ok(Enter::Skip);
        }
        let output = match code_block(turn) {
            Some(code) => {
                let execution = run_python(&code, &self.config);
                if let Some(stats) = &self.stats {
                    stats.record(
                        execution.outcome == Outcome::Exited(0),
                        execution.outcome == Outcome::TimedOut,
                    );
                }
                execution.message(self.config.limits.timeout)
            }
            None => {
                "error: no <code> block found; write Python inside <code>...</code>".to_string()
            }
        };
        cx.inject(&format!("<output>{output}</output>"));
        Ok(Enter::Run)
    }
}

/// The code of the last `<code>` block of `turn`, without a surrounding Markdown fence (```` ```python ````
/// ... ```` ``` ````); `None` when there is no block or it holds only whitespace.
pub fn code_block(turn: &str) -> Option<String> {
    let code = last_tag(turn, "code")?;
    let mut code = code.trim_matches(|c| c == '\n' || c == '\r');
    let trimmed = code.trim();
    if let Some(rest) = trimmed.strip_prefix("```") {
        // Drop the opening fence line (with its language) and a closing fence.
        let body = rest.split_once('\n').map_or("", |(_, body)| body);
        code = body
            .trim_end()
            .strip_suffix("```")
            .unwrap_or(body)
            .trim_end();
    }
    (!code.trim().is_empty()).then(|| code.to_string())
}

/// Whether code runs without network access here: in the sandbox, or (unsandboxed) under
/// `unshare -rn`; checked once per process.
pub fn network_isolation() -> bool {
    sandbox::available().is_ok() || unshare().is_some()
}

/// The `unshare` program when `unshare -rn true` succeeds here; checked once per process, with a
/// warning on stderr when it does not (only unsandboxed runs, which were explicitly allowed, use it).
fn unshare() -> Option<&'static Path> {
    static UNSHARE: OnceLock<Option<PathBuf>> = OnceLock::new();
    UNSHARE
        .get_or_init(|| {
            let unshare = find_in_path("unshare")
                .filter(|_| cfg!(target_os = "linux"))
                .filter(|unshare| {
                    Command::new(unshare)
                        .args(["-rn", "true"])
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .status()
                        .is_ok_and(|status| status.success())
                });
            if unshare.is_none() {
                eprintln!(
                    "warning: CodeExecutor cannot isolate the network here (`unshare -rn` does not \
                     work); unsandboxed model code runs with the host's network"
                );
            }
            unshare
        })
        .as_deref()
}

fn failed(message: String) -> Execution {
    Execution {
        output: String::new(),
        truncated: 0,
        stderr_bytes: 0,
        outcome: Outcome::Failed(message),
        network_isolated: false,
        sandboxed: false,
    }
}

/// Runs `code` with the interpreter of `config` as [`CodeExecutor`] describes: in the sandbox; or,
/// where this machine cannot sandbox, unsandboxed if `config.allow_unsandboxed`, and not at all
/// otherwise. Never panics: everything that goes wrong is in the [`Execution`].
pub fn run_python(code: &str, config: &PythonConfig) -> Execution {
    match sandbox::available() {
        Ok(()) => run_sandboxed(code, config),
        Err(_) if config.allow_unsandboxed => run_python_unsandboxed(code, config),
        Err(reason) => failed(refusal(reason)),
    }
}

/// An interpreter as the sandbox needs it: the real executable (not a launcher such as a pyenv shim,
/// which lives in the user's home) and the folders of its installation, to expose read-only.
#[derive(Debug, Clone)]
struct Interpreter {
    executable: PathBuf,
    prefixes: Vec<PathBuf>,
}

/// Asks `python` (the configured interpreter, run as the current user with this trusted one-liner)
/// where it lives; once per interpreter and process.
fn interpreter(python: &str) -> Result<Interpreter, String> {
    static CACHE: OnceLock<Mutex<HashMap<String, Result<Interpreter, String>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(known) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(python) {
        return known.clone();
    }
    let found = locate(python);
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(python.to_string(), found.clone());
    found
}

fn locate(python: &str) -> Result<Interpreter, String> {
    let Some(path) = resolve(python) else {
        return Err(format!("cannot run Python: `{python}` was not found"));
    };
    const WHERE: &str =
        "import json, os, sys; print(json.dumps([os.path.realpath(sys.executable), \
                         sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))";
    let output = Command::new(&path)
        .args(["-I", "-c", WHERE])
        .stdin(Stdio::null())
        .output()
        .map_err(|error| format!("cannot run Python (`{}`): {error}", path.display()))?;
    let paths: Vec<PathBuf> = std::str::from_utf8(&output.stdout)
        .ok()
        .and_then(|text| serde_json::from_str(text.trim()).ok())
        .filter(|paths: &Vec<PathBuf>| output.status.success() && !paths.is_empty())
        .ok_or_else(|| {
            format!(
                "`{}` did not say where its installation is ({}): {}",
                path.display(),
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )
        })?;
    let executable = paths[0].clone();
    let mut prefixes: Vec<PathBuf> = paths[1..]
        .iter()
        .map(PathBuf::as_path)
        .chain(executable.parent())
        .filter(|prefix| prefix.is_dir())
        .map(Path::to_path_buf)
        .collect();
    prefixes.sort();
    prefixes.dedup();
    Ok(Interpreter {
        executable,
        prefixes,
    })
}

#[cfg(target_os = "linux")]
fn run_sandboxed(code: &str, config: &PythonConfig) -> Execution {
    let interpreter = match interpreter(&config.python) {
        Ok(interpreter) => interpreter,
        Err(message) => return failed(message),
    };
    let mut sandbox = Sandbox::new(config.limits.clone());
    for prefix in &interpreter.prefixes {
        sandbox = sandbox.expose(prefix);
    }
    let bin = interpreter
        .executable
        .parent()
        .map_or(String::new(), |dir| format!("{}:", dir.display()));
    let job = Job::new(&interpreter.executable)
        .args(["-I", "-X", "utf8", "-"])
        .env("PATH", format!("{bin}/usr/local/bin:/usr/bin:/bin"))
        .env("HOME", sandbox::view::WORKDIR)
        .env("TMPDIR", sandbox::view::WORKDIR)
        .env("LANG", "C.UTF-8")
        .stdin(code)
        .max_output(config.max_output);
    let run = match sandbox.run(&job) {
        Ok(run) => run,
        Err(error) => return failed(error.to_string()),
    };
    let outcome = match run.status {
        Status::Exited(code) => Outcome::Exited(code),
        Status::Signal(signal) => Outcome::Signal(signal),
        Status::TimedOut => Outcome::TimedOut,
    };
    let (output, truncated) = combine(
        run.stdout,
        run.stdout_dropped,
        &run.stderr,
        run.stderr_dropped,
        config.max_output,
    );
    Execution {
        output,
        truncated,
        stderr_bytes: run.stderr.len() + run.stderr_dropped,
        outcome,
        network_isolated: true,
        sandboxed: true,
    }
}

#[cfg(not(target_os = "linux"))]
fn run_sandboxed(_code: &str, _config: &PythonConfig) -> Execution {
    failed(refusal("the sandbox uses Linux namespaces"))
}

/// Stdout then stderr, at most `max_output` bytes, as text; and the bytes dropped.
fn combine(
    mut bytes: Vec<u8>,
    out_dropped: usize,
    err: &[u8],
    err_dropped: usize,
    max_output: usize,
) -> (String, usize) {
    let room = max_output.saturating_sub(bytes.len());
    let kept = err.len().min(room);
    bytes.extend_from_slice(&err[..kept]);
    let truncated = out_dropped + err_dropped + (err.len() - kept);
    let (output, cut) = utf8_prefix(&bytes);
    (output, truncated + cut)
}

/// Runs `code` without the sandbox, as [`run_python`] does where the machine cannot sandbox and that was
/// allowed: a fresh temporary folder (removed afterwards), an empty environment, a process group killed
/// at the timeout and after the exit, no network under `unshare -rn` where that works. The code runs as
/// the current user, with its rights: only for trusted code. `config.limits` other than the timeout
/// are not enforced.
pub fn run_python_unsandboxed(code: &str, config: &PythonConfig) -> Execution {
    let Some(python) = resolve(&config.python) else {
        return failed(format!(
            "cannot run Python: `{}` was not found",
            config.python
        ));
    };
    let dir = match TempDir::new() {
        Ok(dir) => dir,
        Err(error) => return failed(format!("cannot create a temporary directory: {error}")),
    };
    let unshare = unshare();
    let mut command = match unshare {
        Some(unshare) => {
            let mut command = Command::new(unshare);
            command.arg("-rn").arg(&python);
            command
        }
        None => Command::new(&python),
    };
    command
        .args(["-I", "-X", "utf8", "-"])
        .current_dir(dir.path())
        .env_clear()
        .env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into()),
        )
        .env("HOME", dir.path())
        .env("TMPDIR", dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        command.process_group(0);
    }
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(error) => {
            return failed(format!(
                "cannot run Python (`{}`): {error}",
                python.display()
            ))
        }
    };
    let pid = child.id();
    let mut stdin = child.stdin.take();
    let code = code.as_bytes().to_vec();
    std::thread::spawn(move || {
        if let Some(stdin) = stdin.as_mut() {
            // A process that exits before reading all of its code closes the pipe: nothing to report.
            let _ = stdin.write_all(&code);
        }
    });
    let stdout = Capture::start(child.stdout.take(), config.max_output);
    let stderr = Capture::start(child.stderr.take(), config.max_output);

    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(child.wait());
    });
    let status = receiver.recv_timeout(config.limits.timeout).ok();
    // Kill the whole group: after a timeout, and after an exit to end children the code left behind
    // (which would otherwise hold the output pipes open).
    kill_group(pid);
    let outcome = match status {
        None => {
            let _ = receiver.recv_timeout(Duration::from_secs(5));
            Outcome::TimedOut
        }
        Some(Ok(status)) => exit_outcome(status),
        Some(Err(error)) => Outcome::Failed(format!("waiting for Python failed: {error}")),
    };
    // A process that escaped the group kill (it started a new session) could hold a stream open:
    // then what was read so far is taken.
    let (out, out_dropped) = stdout.finish(Duration::from_millis(500));
    let (err, err_dropped) = stderr.finish(Duration::from_millis(500));
    let stderr_bytes = err.len() + err_dropped;
    let (output, truncated) = combine(out, out_dropped, &err, err_dropped, config.max_output);
    drop(dir);
    Execution {
        output,
        truncated,
        stderr_bytes,
        outcome,
        network_isolated: unshare.is_some(),
        sandboxed: false,
    }
}

fn exit_outcome(status: ExitStatus) -> Outcome {
    if let Some(code) = status.code() {
        return Outcome::Exited(code);
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            return Outcome::Signal(signal);
        }
    }
    Outcome::Failed(format!("Python ended abnormally: {status}"))
}

/// Sends `SIGKILL` to the process group `pid` leads (no error when it is gone).
#[cfg(unix)]
fn kill_group(pid: u32) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        // SAFETY: kill(2) with a negative pid signals that process group; it has no memory effects.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
}

#[cfg(not(unix))]
fn kill_group(_pid: u32) {}

/// The text of `bytes` (invalid UTF-8 replaced), without a multi-byte character cut at the end; also
/// how many bytes of such a cut character were dropped.
fn utf8_prefix(bytes: &[u8]) -> (String, usize) {
    let mut end = bytes.len();
    if let Err(error) = std::str::from_utf8(bytes) {
        if error.error_len().is_none() {
            end = error.valid_up_to();
        }
    }
    (
        String::from_utf8_lossy(&bytes[..end]).into_owned(),
        bytes.len() - end,
    )
}

/// The path of `program`: itself when it names a path, else the first executable file of that name in
/// `PATH`.
fn resolve(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        let path = PathBuf::from(program);
        return is_executable(&path).then_some(path);
    }
    find_in_path(program)
}

fn find_in_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    let Ok(metadata) = std::fs::metadata(path) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        metadata.is_file() && metadata.permissions().mode() & 0o111 != 0
    }
    #[cfg(not(unix))]
    {
        metadata.is_file()
    }
}

/// A fresh directory under the system's temporary directory (mode 0700), removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> io::Result<Self> {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let base = std::env::temp_dir();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.subsec_nanos());
        let mut last_error = None;
        for _ in 0..16 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = base.join(format!("holo-code-{}-{n}-{nanos}", std::process::id()));
            let mut builder = std::fs::DirBuilder::new();
            #[cfg(unix)]
            {
                use std::os::unix::fs::DirBuilderExt;
                builder.mode(0o700);
            }
            match builder.create(&path) {
                Ok(()) => return Ok(TempDir(path)),
                Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
                    last_error = Some(error)
                }
                Err(error) => return Err(error),
            }
        }
        Err(last_error.unwrap_or_else(|| io::Error::other("no free name")))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::fs::remove_dir_all(&self.0).is_err() {
            // The code may have removed its own write permissions: restore them and try again.
            make_writable(&self.0);
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Gives the owner full permissions on `dir` and every directory below it (symlinks are not followed).
fn make_writable(dir: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                    make_writable(&entry.path());
                }
            }
        }
    }
    #[cfg(not(unix))]
    let _ = dir;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_blocks() {
        assert_eq!(
            code_block("<reasoning>x</reasoning>\n<code>\nprint(1)\n</code>").as_deref(),
            Some("print(1)")
        );
        assert_eq!(
            code_block("<code>a=1</code> then <code>\n```python\nprint(2)\n```\n</code>")
                .as_deref(),
            Some("print(2)")
        );
        assert_eq!(
            code_block("<code>\n    x = 1\n    print(x)").as_deref(),
            Some("    x = 1\n    print(x)")
        );
        assert_eq!(code_block("no code"), None);
        assert_eq!(code_block("<code>  \n</code>"), None);
    }

    #[test]
    fn utf8_prefix_drops_a_cut_character() {
        let bytes = "aé".as_bytes();
        assert_eq!(utf8_prefix(&bytes[..2]), ("a".to_string(), 1));
        assert_eq!(utf8_prefix(bytes), ("aé".to_string(), 0));
        assert_eq!(utf8_prefix(b"a\xffb"), ("a\u{fffd}b".to_string(), 0));
    }

    #[test]
    fn messages() {
        let execution = |output: &str, truncated, outcome| Execution {
            output: output.to_string(),
            truncated,
            stderr_bytes: 0,
            outcome,
            network_isolated: true,
            sandboxed: true,
        };
        let timeout = Duration::from_secs(3);
        assert_eq!(
            execution("", 0, Outcome::Exited(0)).message(timeout),
            "(no output)"
        );
        assert_eq!(
            execution("391\n", 0, Outcome::Exited(0)).message(timeout),
            "391"
        );
        assert_eq!(
            execution("x", 10, Outcome::Exited(0)).message(timeout),
            "x\n[output truncated: 10 more bytes]"
        );
        assert_eq!(
            execution("", 0, Outcome::Exited(3)).message(timeout),
            "error: the code exited with status 3"
        );
        assert_eq!(
            execution("1\n", 0, Outcome::TimedOut).message(Duration::from_millis(1500)),
            "1\nerror: the code timed out after 1.5 s and was stopped"
        );
    }
}
