//! Code execution as a tool: [`CodeExecutor`] runs the Python code of the model's turn in a subprocess
//! ([`run_python`]) and writes what it printed inside `<output>` tags.
//!
//! How code runs is described on [`CodeExecutor`].

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::holotype::{Args, Cx, Enter, Holotype, HolotypeError};
use crate::holotypes::tools::last_tag;

/// How [`run_python`] runs code.
#[derive(Debug, Clone, PartialEq)]
pub struct PythonConfig {
    /// The interpreter: a name looked up in `PATH`, or a path (default `python3`).
    pub python: String,
    /// Wall-clock limit (default 5 s).
    pub timeout: Duration,
    /// Bytes of output kept, stdout and stderr together (default 4096).
    pub max_output: usize,
}

impl Default for PythonConfig {
    fn default() -> Self {
        PythonConfig {
            python: "python3".to_string(),
            timeout: Duration::from_secs(5),
            max_output: 4096,
        }
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
    /// Whether the code ran without network access (under `unshare -rn`).
    pub network_isolated: bool,
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
            Outcome::Signal(signal) => {
                note(format!("error: the code was killed by signal {signal}"))
            }
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

fn seconds(duration: Duration) -> String {
    let secs = duration.as_secs_f64();
    if secs.fract() == 0.0 {
        format!("{secs:.0} s")
    } else {
        format!("{secs} s")
    }
}

/// `<|CodeExecutor turn|>`: runs the Python code of the last `<code>...</code>` block of the variable
/// `turn` (an unclosed last block runs to the end of the turn; a Markdown fence inside the block is
/// removed) and writes `<output>...</output>`. When the turn holds an answer (`answer=` tag, default
/// `answer`) nothing runs and its body, if any, is skipped. Parameters: `timeout` (seconds, default 5),
/// `python` (the interpreter, default `python3`), `max_output` (bytes, default 4096). Everything that goes
/// wrong (no code, an exception, a timeout, no interpreter) is written to the model inside `<output>`.
///
/// # How code runs
///
/// Each run ([`run_python`]) gets:
/// - a fresh temporary directory, its working directory and `HOME`, removed afterwards (files the code
///   writes do not persist from one run to the next);
/// - an empty environment except `PATH`, `HOME` and `TMPDIR` (both the temporary directory), and the
///   interpreter in isolated mode, `python3 -I -X utf8 -` (no user site-packages, no `PYTHON*`
///   variables, the code read from stdin);
/// - a wall-clock timeout: the subprocess runs in its own process group, and the whole group (anything
///   the code started too) is killed with `SIGKILL` when the time is up, and again after a normal exit to
///   clean up leftover children;
/// - a cap on the output kept (stdout, then stderr), the rest counted and reported as truncated;
/// - no network, **best effort**: on Linux the interpreter runs under `unshare -rn` (a new user and
///   network namespace, which has only a loopback interface that is down) when that works on the machine,
///   checked once per process with `unshare -rn true`. Where it does not (no `unshare`, user namespaces
///   disabled, another OS), the code runs **with the host's network**, and a warning is printed on stderr
///   once; [`network_isolation`] tells which. This is not a security sandbox: the code runs as the
///   current user and can read what that user can read.
pub struct CodeExecutor {
    variable: String,
    answer: String,
    config: PythonConfig,
}

impl Holotype for CodeExecutor {
    const PARAMS: &'static [&'static str] = &["timeout", "python", "max_output", "answer"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        let mut config = PythonConfig::default();
        if let Some(timeout) = args.float("timeout")? {
            if !(timeout > 0.0 && timeout <= 86_400.0) {
                return Err(HolotypeError::new(format!(
                    "timeout must be a number of seconds above 0 (at most 86400), found {timeout}"
                )));
            }
            config.timeout = Duration::from_secs_f64(timeout);
        }
        if let Some(python) = args.text("python")? {
            if python.is_empty() {
                return Err(HolotypeError::new("python must name an interpreter"));
            }
            config.python = python.to_string();
        }
        if let Some(max_output) = args.count("max_output")? {
            if max_output == 0 {
                return Err(HolotypeError::new("max_output must be at least 1"));
            }
            config.max_output = max_output as usize;
        }
        Ok(CodeExecutor {
            variable: args.words().next().unwrap_or("turn").to_string(),
            answer: args.text("answer")?.unwrap_or("answer").to_string(),
            config,
        })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        let turn = cx.var(&self.variable).unwrap_or_default();
        if turn.contains(&format!("<{}>", self.answer)) {
            return Ok(Enter::Skip);
        }
        let output = match code_block(turn) {
            Some(code) => run_python(&code, &self.config).message(self.config.timeout),
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

/// Whether code runs without network access here (`unshare -rn` works); checked once per process.
pub fn network_isolation() -> bool {
    unshare().is_some()
}

/// The `unshare` program when `unshare -rn true` succeeds here; checked once per process, with a
/// warning on stderr when it does not.
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
                     work); model code runs with the host's network"
                );
            }
            unshare
        })
        .as_deref()
}

/// Runs `code` with the interpreter of `config` as [`CodeExecutor`] describes. Never
/// panics: everything that goes wrong is in the [`Execution`].
pub fn run_python(code: &str, config: &PythonConfig) -> Execution {
    let failed = |message: String| Execution {
        output: String::new(),
        truncated: 0,
        stderr_bytes: 0,
        outcome: Outcome::Failed(message),
        network_isolated: false,
    };
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
    let status = receiver.recv_timeout(config.timeout).ok();
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
    let (out, out_dropped) = stdout.finish();
    let (err, err_dropped) = stderr.finish();
    let mut bytes = out;
    let room = config.max_output.saturating_sub(bytes.len());
    let kept = err.len().min(room);
    bytes.extend_from_slice(&err[..kept]);
    let truncated = out_dropped + err_dropped + (err.len() - kept);
    let (output, cut) = utf8_prefix(&bytes);
    drop(dir);
    Execution {
        output,
        truncated: truncated + cut,
        stderr_bytes: err.len() + err_dropped,
        outcome,
        network_isolated: unshare.is_some(),
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

/// One output stream, read on its own thread: the first `limit` bytes kept, the rest counted.
struct Capture {
    state: Arc<Mutex<(Vec<u8>, usize)>>,
    done: mpsc::Receiver<()>,
}

impl Capture {
    fn start(stream: Option<impl Read + Send + 'static>, limit: usize) -> Self {
        let state = Arc::new(Mutex::new((Vec::new(), 0)));
        let (sender, done) = mpsc::channel();
        let shared = Arc::clone(&state);
        std::thread::spawn(move || {
            if let Some(mut stream) = stream {
                let mut buffer = [0u8; 8192];
                loop {
                    match stream.read(&mut buffer) {
                        Ok(0) => break,
                        Ok(n) => {
                            let mut state = shared.lock().unwrap_or_else(|e| e.into_inner());
                            let room = limit.saturating_sub(state.0.len()).min(n);
                            state.0.extend_from_slice(&buffer[..room]);
                            state.1 += n - room;
                        }
                        Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
            }
            let _ = sender.send(());
        });
        Capture { state, done }
    }

    /// What was read. Waits a little for the stream to end: a process that escaped the group kill (it
    /// started a new session) could hold it open, and then what was read so far is taken.
    fn finish(self) -> (Vec<u8>, usize) {
        let _ = self.done.recv_timeout(Duration::from_millis(500));
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        (std::mem::take(&mut state.0), state.1)
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
