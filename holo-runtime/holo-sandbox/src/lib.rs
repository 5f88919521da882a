//! A sandbox for untrusted programs, such as the code a model writes during training: run a command
//! with files in, get its output and exit status out, and nothing it does reaches the run or the
//! machine.
//!
//! ```no_run
//! use holo_sandbox::{Job, Limits, Sandbox};
//!
//! let sandbox = Sandbox::new(Limits::default());
//! let job = Job::new("/usr/bin/python3")
//!     .args(["-I", "main.py"])
//!     .file("main.py", "print(6 * 7)");
//! let run = sandbox.run(&job)?;
//! assert_eq!(run.stdout, b"42\n");
//! # Ok::<(), holo_sandbox::SandboxError>(())
//! ```
//!
//! # What a run gets
//!
//! Linux only, built on the kernel's own mechanisms (no helper program, no daemon, no root needed):
//! - new user, PID, mount, network, IPC, UTS and cgroup namespaces, created by one `clone` of the
//!   calling process. The program runs as PID 2 under an init of the sandbox's own (PID 1); it sees no
//!   process of the host, and when the run ends (exit, timeout) init exits and the kernel kills every
//!   process left in the namespace: daemons, double forks and `setsid` included.
//! - an unprivileged user (uid and gid 1000 inside), mapped to `nobody`/`nogroup` (65534) of the host
//!   when the caller is root, else to the caller's own uid; no capabilities at all (bounding set
//!   cleared), `no_new_privs`, no supplementary groups when the caller is root.
//! - a fresh root file system ([`view`]): read-only binds of `/usr`, `/lib*`, `/bin`, `/sbin`, the
//!   loader's cache, and the paths given to [`Sandbox::expose`] (an interpreter's prefix); a minimal
//!   `/dev`; a fresh `/proc` of its own PID namespace; and a writable work folder, `/tmp`, a tmpfs
//!   capped at [`Limits::work_size`] that disappears with the run.
//! - no network: the network namespace has only a loopback interface, down.
//! - resource limits ([`Limits`]) on every process: address space, processes, file size, open files,
//!   CPU seconds; a wall-clock timeout for the whole run; output kept up to a cap, the rest counted.
//! - a seccomp filter denying what code never needs ([`seccomp`]): `ptrace`, `mount`, namespaces,
//!   `kexec`, `bpf`, keyrings, `perf_event_open`, `io_uring`, `userfaultfd`, ...
//!
//! [`available`] says whether this machine can do all of that (user namespaces may be disabled); where
//! it cannot, [`Sandbox::run`] fails with [`SandboxError::Unavailable`] and nothing runs.

mod limits;
mod output;

#[cfg(target_os = "linux")]
mod child;
#[cfg(target_os = "linux")]
pub mod seccomp;
#[cfg(target_os = "linux")]
pub mod view;

pub use limits::Limits;
pub use output::Capture;

use std::fmt;
use std::path::PathBuf;
use std::sync::OnceLock;

/// The uid and gid of the program inside the sandbox.
pub const SANDBOX_UID: u32 = 1000;

/// The host uid and gid the sandbox's user maps to when the caller is root (`nobody`, `nogroup`).
pub const HOST_NOBODY: u32 = 65534;

/// One program to run: the executable (a path inside the sandbox, which sees the host's system
/// folders at their usual places), its arguments, its environment (nothing else is passed), its
/// standard input and the files to put in the work folder first.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Job {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub stdin: Vec<u8>,
    /// `(name, contents)`: plain file names, written into the work folder.
    pub files: Vec<(String, Vec<u8>)>,
    /// Bytes of stdout (and of stderr) kept; the rest is counted (default 64 KiB).
    pub max_output: usize,
}

impl Job {
    pub fn new(program: impl Into<PathBuf>) -> Self {
        Job {
            program: program.into(),
            max_output: 64 * 1024,
            ..Job::default()
        }
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    pub fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    pub fn stdin(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.stdin = bytes.into();
        self
    }

    pub fn file(mut self, name: impl Into<String>, contents: impl Into<Vec<u8>>) -> Self {
        self.files.push((name.into(), contents.into()));
        self
    }

    pub fn max_output(mut self, bytes: usize) -> Self {
        self.max_output = bytes;
        self
    }
}

/// How the program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// It exited with this code.
    Exited(i32),
    /// It was killed by this signal (`SIGXCPU` past the CPU limit, `SIGKILL`, `SIGSEGV`, ...).
    Signal(i32),
    /// The wall-clock timeout passed; every process of the sandbox was killed.
    TimedOut,
}

/// What a run produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub status: Status,
    /// The first [`Job::max_output`] bytes of stdout.
    pub stdout: Vec<u8>,
    /// Bytes of stdout beyond the cap.
    pub stdout_dropped: usize,
    pub stderr: Vec<u8>,
    pub stderr_dropped: usize,
}

/// Why a run did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SandboxError {
    /// This machine cannot sandbox (not Linux, user namespaces disabled, ...): what is missing.
    Unavailable(String),
    /// The job or the limits are invalid, or the sandbox could not be set up for this job (for
    /// instance the program does not exist inside it).
    Setup(String),
}

impl fmt::Display for SandboxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SandboxError::Unavailable(reason) => {
                write!(f, "this machine cannot sandbox code: {reason}")
            }
            SandboxError::Setup(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for SandboxError {}

/// Runs jobs isolated as the [module](self) describes, with these limits, seeing these host paths.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Sandbox {
    pub limits: Limits,
    exposed: Vec<PathBuf>,
}

impl Sandbox {
    pub fn new(limits: Limits) -> Self {
        Sandbox {
            limits,
            exposed: Vec::new(),
        }
    }

    /// Makes the host path `path` visible, read-only, at the same place inside the sandbox (an
    /// interpreter's prefix, a dataset). Never expose a folder holding secrets or the run.
    pub fn expose(mut self, path: impl Into<PathBuf>) -> Self {
        self.exposed.push(path.into());
        self
    }

    /// The host paths exposed by [`Sandbox::expose`].
    pub fn exposed(&self) -> &[PathBuf] {
        &self.exposed
    }

    /// Runs `job` and waits for it (at most the timeout, plus the time to kill it).
    pub fn run(&self, job: &Job) -> Result<Run, SandboxError> {
        available().map_err(|reason| SandboxError::Unavailable(reason.to_string()))?;
        self.limits.validate().map_err(SandboxError::Setup)?;
        imp::run(self, job, false)
    }
}

/// Whether this machine can run the sandbox, checked once per process by setting one up (every step
/// but the final `execve`); the error says what is missing.
pub fn available() -> Result<(), &'static str> {
    static AVAILABLE: OnceLock<Result<(), String>> = OnceLock::new();
    AVAILABLE
        .get_or_init(probe)
        .as_ref()
        .map(|_| ())
        .map_err(|reason| reason.as_str())
}

#[cfg(target_os = "linux")]
fn probe() -> Result<(), String> {
    if !seccomp::SUPPORTED {
        return Err(format!(
            "the seccomp filter is built for x86-64 and aarch64 only, not {}",
            std::env::consts::ARCH
        ));
    }
    let job = Job::new("/probe");
    match imp::run(&Sandbox::default(), &job, true) {
        Ok(run) if run.status == Status::Exited(0) => Ok(()),
        Ok(run) => Err(format!("the sandbox's probe ended with {:?}", run.status)),
        Err(SandboxError::Unavailable(reason) | SandboxError::Setup(reason)) => Err(format!(
            "{reason} (user namespaces must be enabled: sysctl kernel.unprivileged_userns_clone=1 \
             and user.max_user_namespaces > 0; AppArmor's \
             kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 24.04; in a container, a \
             seccomp profile that allows clone with CLONE_NEWUSER)"
        )),
    }
}

#[cfg(not(target_os = "linux"))]
fn probe() -> Result<(), String> {
    Err(format!(
        "the sandbox uses Linux namespaces, and this is {}",
        std::env::consts::OS
    ))
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use super::*;

    pub(super) fn run(_: &Sandbox, _: &Job, _: bool) -> Result<Run, SandboxError> {
        Err(SandboxError::Unavailable(format!(
            "the sandbox uses Linux namespaces, and this is {}",
            std::env::consts::OS
        )))
    }
}

#[cfg(target_os = "linux")]
mod imp {
    use std::ffi::CString;
    use std::fs::File;
    use std::io::{Read, Write};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::sync::mpsc;
    use std::time::Duration;

    use super::child::{self, Fds, Plan, Stage, Step, FAILURE_BYTES};
    use super::{seccomp, view, Capture, Job, Run, Sandbox, SandboxError, Status};
    use super::{HOST_NOBODY, SANDBOX_UID};

    /// A pipe `(read, write)`, both ends close-on-exec and numbered 3 or above (so that the worker's
    /// `dup2` onto 0, 1 and 2 never overwrites one of them).
    fn pipe() -> Result<(OwnedFd, OwnedFd), SandboxError> {
        let mut fds = [0; 2];
        // SAFETY: pipe2(2) into a two-element array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(SandboxError::Setup(format!(
                "cannot create a pipe for the sandbox: {}",
                std::io::Error::last_os_error()
            )));
        }
        let mut owned = fds.map(|fd| {
            // SAFETY: fresh descriptors owned from here on.
            unsafe { OwnedFd::from_raw_fd(fd) }
        });
        for end in &mut owned {
            if end.as_raw_fd() < 3 {
                // SAFETY: fcntl(2) duplicating a descriptor we own.
                let fd = unsafe { libc::fcntl(end.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
                if fd < 0 {
                    return Err(SandboxError::Setup(format!(
                        "cannot create a pipe for the sandbox: {}",
                        std::io::Error::last_os_error()
                    )));
                }
                // SAFETY: as above.
                *end = unsafe { OwnedFd::from_raw_fd(fd) };
            }
        }
        let [read, write] = owned;
        Ok((read, write))
    }

    fn c_string(text: &str, what: &str) -> Result<CString, SandboxError> {
        CString::new(text)
            .map_err(|_| SandboxError::Setup(format!("the {what} contains a NUL byte: {text:?}")))
    }

    fn write_proc(pid: libc::pid_t, file: &str, contents: &str) -> Result<(), SandboxError> {
        let path = format!("/proc/{pid}/{file}");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut handle| handle.write_all(contents.as_bytes()))
            .map_err(|error| {
                SandboxError::Unavailable(format!("cannot write {path} ({contents:?}): {error}"))
            })
    }

    /// What a failure record from the error pipe means.
    fn describe(record: &[u8], plan: &Plan) -> String {
        let word = |at: usize| u32::from_ne_bytes(record[at..at + 4].try_into().expect("4 bytes"));
        let (stage, index, errno) = (word(0), word(4) as usize, word(8) as i32);
        let error = std::io::Error::from_raw_os_error(errno);
        let what = match child::Stage::from_code(stage) {
            Some(Stage::Identity) => format!(
                "switching to the sandbox's user ({})",
                ["setresgid", "setgroups", "keepcaps", "setresuid", "capset"]
                    .get(index)
                    .unwrap_or(&"?")
            ),
            Some(Stage::Private) => "making the mounts private".into(),
            Some(Stage::Step) => match plan.steps.get(index) {
                Some(Step::Bind { target, .. }) => format!("binding {target:?}"),
                // Not `{step:?}`: that would print every byte of the file.
                Some(Step::Write { path, .. }) => format!("writing {path:?}"),
                Some(step) => format!("{step:?}"),
                None => format!("step {index}"),
            },
            Some(Stage::Hostname) => "setting the host name".into(),
            Some(Stage::Pivot) => "entering the new root (pivot_root)".into(),
            Some(Stage::ReadOnly) => format!("making {:?} read-only", plan.read_only.get(index)),
            Some(Stage::Fork) => "starting the worker process".into(),
            Some(Stage::Stdio) => "connecting standard input and output".into(),
            Some(Stage::Rlimit) => format!("setting resource limit {:?}", plan.rlimits.get(index)),
            Some(Stage::Capabilities) => "dropping capabilities".into(),
            Some(Stage::NoNewPrivs) => "setting no_new_privs".into(),
            Some(Stage::Seccomp) => "installing the seccomp filter".into(),
            Some(Stage::Workdir) => "entering the work folder".into(),
            Some(Stage::Exec) => {
                return format!("cannot run {:?} in the sandbox: {error}", plan.program)
            }
            None => format!("unknown stage {stage}"),
        };
        format!("the sandbox could not be set up: {what} failed: {error}")
    }

    pub(super) fn run(sandbox: &Sandbox, job: &Job, probe: bool) -> Result<Run, SandboxError> {
        let limits = &sandbox.limits;
        // SAFETY: getters without side effects.
        let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let root = euid == 0;
        let built = view::build(
            &sandbox.exposed,
            &job.files,
            limits,
            SANDBOX_UID,
            SANDBOX_UID,
        )
        .map_err(SandboxError::Setup)?;

        let program = CString::new(job.program.as_os_str().as_encoded_bytes()).map_err(|_| {
            SandboxError::Setup(format!(
                "the program path {:?} contains a NUL byte",
                job.program
            ))
        })?;
        let mut strings = vec![program.clone()];
        for arg in &job.args {
            strings.push(c_string(arg, "argument")?);
        }
        let arg_count = strings.len();
        for (name, value) in &job.env {
            if name.is_empty() || name.contains('=') {
                return Err(SandboxError::Setup(format!(
                    "invalid environment variable name {name:?}"
                )));
            }
            strings.push(c_string(&format!("{name}={value}"), "environment")?);
        }
        let pointers = |range: std::ops::Range<usize>| {
            let mut list: Vec<*const libc::c_char> =
                strings[range].iter().map(|s| s.as_ptr()).collect();
            list.push(std::ptr::null());
            list
        };

        let (stdin_read, stdin_write) = pipe()?;
        let (stdout_read, stdout_write) = pipe()?;
        let (stderr_read, stderr_write) = pipe()?;
        let (go_read, go_write) = pipe()?;
        let (error_read, error_write) = pipe()?;
        let (status_read, status_write) = pipe()?;

        let plan = Plan {
            steps: built.steps,
            stage: built.stage,
            read_only: built.read_only,
            hostname: CString::new("sandbox").expect("no NUL"),
            uid: SANDBOX_UID,
            gid: SANDBOX_UID,
            drop_groups: root,
            program,
            argv: pointers(0..arg_count),
            envp: pointers(arg_count..strings.len()),
            workdir: CString::new(view::WORKDIR).expect("no NUL"),
            rlimits: limits.rlimits(),
            filter: seccomp::filter(),
            fds: Fds {
                stdin: stdin_read.as_raw_fd(),
                stdout: stdout_write.as_raw_fd(),
                stderr: stderr_write.as_raw_fd(),
                go: go_read.as_raw_fd(),
                error: error_write.as_raw_fd(),
                status: status_write.as_raw_fd(),
            },
            probe,
        };

        let flags = libc::CLONE_NEWUSER
            | libc::CLONE_NEWPID
            | libc::CLONE_NEWNS
            | libc::CLONE_NEWNET
            | libc::CLONE_NEWIPC
            | libc::CLONE_NEWUTS
            | libc::CLONE_NEWCGROUP
            | libc::SIGCHLD;
        // SAFETY: clone(2) without a new stack, like fork(2); the child runs only `child::init`, which
        // makes system calls on the plan and never returns.
        let pid = unsafe {
            libc::syscall(
                libc::SYS_clone,
                flags as libc::c_ulong,
                0usize,
                0usize,
                0usize,
                0usize,
            )
        } as libc::pid_t;
        if pid == 0 {
            // SAFETY: in the clone's child, as `init` requires.
            unsafe { child::init(&plan) }
        }
        if pid < 0 {
            let error = std::io::Error::last_os_error();
            return Err(SandboxError::Unavailable(format!(
                "cannot create the sandbox's namespaces (clone with CLONE_NEWUSER | CLONE_NEWPID | \
                 CLONE_NEWNS | CLONE_NEWNET): {error}"
            )));
        }
        // The child's ends, and the bind sources, belong to the sandbox now.
        drop((stdin_read, stdout_write, stderr_write, go_read));
        drop((error_write, status_write));
        drop(built.sources);

        let mapped = if root {
            (HOST_NOBODY, HOST_NOBODY)
        } else {
            (euid, egid)
        };
        let maps = (|| {
            if !root {
                write_proc(pid, "setgroups", "deny")?;
            }
            write_proc(pid, "uid_map", &format!("{SANDBOX_UID} {} 1\n", mapped.0))?;
            write_proc(pid, "gid_map", &format!("{SANDBOX_UID} {} 1\n", mapped.1))
        })();
        let waiter = Waiter::start(pid);
        if let Err(error) = maps {
            // Closing `go` unwritten ends init; kill it anyway, then reap it.
            drop(go_write);
            kill(pid);
            let _ = waiter.wait(Duration::from_secs(10));
            return Err(error);
        }
        let mut go = File::from(go_write);
        if let Err(error) = go.write_all(&[1]) {
            kill(pid);
            let _ = waiter.wait(Duration::from_secs(10));
            return Err(SandboxError::Setup(format!(
                "cannot start the sandbox: {error}"
            )));
        }
        drop(go);

        let stdin = job.stdin.clone();
        let mut stdin_file = File::from(stdin_write);
        std::thread::spawn(move || {
            // A program that exits without reading all its input closes the pipe: nothing to report.
            let _ = stdin_file.write_all(&stdin);
        });
        let stdout = Capture::start(Some(File::from(stdout_read)), job.max_output);
        let stderr = Capture::start(Some(File::from(stderr_read)), job.max_output);

        let first = waiter.wait(limits.timeout);
        let timed_out = first.is_none();
        let init_status = first.or_else(|| {
            kill(pid);
            waiter.wait(Duration::from_secs(30))
        });
        let Some(init_status) = init_status else {
            return Err(SandboxError::Setup(format!(
                "the sandbox's init (pid {pid}) did not end after SIGKILL"
            )));
        };
        // Init is gone, so is every process of the namespace: the pipes' writers are closed.
        let (stdout, stdout_dropped) = stdout.finish(Duration::from_secs(10));
        let (stderr, stderr_dropped) = stderr.finish(Duration::from_secs(10));
        let mut failure = Vec::new();
        let _ = File::from(error_read).read_to_end(&mut failure);
        let mut status_bytes = Vec::new();
        let _ = File::from(status_read).read_to_end(&mut status_bytes);

        if failure.len() >= FAILURE_BYTES && !timed_out {
            return Err(SandboxError::Setup(describe(
                &failure[..FAILURE_BYTES],
                &plan,
            )));
        }
        let status = if timed_out {
            Status::TimedOut
        } else if let Ok(bytes) = <[u8; 4]>::try_from(status_bytes.as_slice()) {
            let status = i32::from_ne_bytes(bytes);
            if libc::WIFEXITED(status) {
                Status::Exited(libc::WEXITSTATUS(status))
            } else if libc::WIFSIGNALED(status) {
                Status::Signal(libc::WTERMSIG(status))
            } else {
                return Err(SandboxError::Setup(format!(
                    "the program ended with wait status {status:#x}"
                )));
            }
        } else {
            return Err(SandboxError::Setup(format!(
                "the sandbox's init ended without reporting the program's status (wait status \
                 {init_status:#x})"
            )));
        };
        Ok(Run {
            status,
            stdout,
            stdout_dropped,
            stderr,
            stderr_dropped,
        })
    }

    fn kill(pid: libc::pid_t) {
        // SAFETY: kill(2) of our own child; SIGKILL to a namespace's init ends the namespace.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }

    /// Waits for the sandbox's init on a thread, so that the caller can wait with a timeout.
    struct Waiter {
        receiver: mpsc::Receiver<i32>,
    }

    impl Waiter {
        fn start(pid: libc::pid_t) -> Self {
            let (sender, receiver) = mpsc::channel();
            std::thread::spawn(move || loop {
                let mut status = 0;
                // SAFETY: waitpid(2) on our own child.
                let result = unsafe { libc::waitpid(pid, &mut status, libc::__WALL) };
                if result == pid {
                    let _ = sender.send(status);
                    return;
                }
                if result < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR)
                {
                    // Reaped by someone else: report it as killed.
                    let _ = sender.send(libc::SIGKILL);
                    return;
                }
            });
            Waiter { receiver }
        }

        /// The wait status of init, or `None` when `timeout` passed first.
        fn wait(&self, timeout: Duration) -> Option<i32> {
            self.receiver.recv_timeout(timeout).ok()
        }
    }
}
