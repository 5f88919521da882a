//! The processes inside the sandbox: its init (PID 1 of the new PID namespace, which builds the
//! file-system view and then waits for the program) and the worker (PID 2, which sets its limits,
//! drops every capability, installs the seccomp filter and executes the program).
//!
//! Both run right after a `clone` of a process that may have many threads, so until `execve` they may
//! only make system calls: no allocation, no locks, no formatting. Everything they need is prepared by
//! the parent in a [`Plan`] (C strings, pointer arrays, the filter), which the clone copies.

use std::ffi::CString;
use std::io;

use libc::{c_char, c_int, c_ulong, c_void, sock_filter};

/// One step of building the sandbox's root, run by init in order; paths are absolute, under the
/// staging folder.
#[derive(Debug)]
pub(super) enum Step {
    /// `mkdir` (mode 0755).
    Dir(CString),
    /// An empty file to bind a host file onto.
    File(CString),
    Symlink {
        target: CString,
        path: CString,
    },
    /// A bind mount of the host path `host`, then, when `remount` is given, a remount of it with
    /// those flags (read-only, and the flags the host mount has and that a user namespace may not
    /// clear). Init opens `host` as descriptor `fd` before it mounts anything (a source under the
    /// staging folder would be hidden after), and binds from `source`, that descriptor's
    /// `/proc/self/fd/N` path. (The parent opened the same path as `fd` to reserve the number; a
    /// descriptor opened outside the sandbox's mount namespace cannot be bound inside it.)
    Bind {
        host: CString,
        fd: c_int,
        source: CString,
        target: CString,
        remount: Option<c_ulong>,
    },
    Tmpfs {
        target: CString,
        options: CString,
    },
    Proc(CString),
    /// A new file with these contents (the job's input files, `/etc/passwd`).
    Write {
        path: CString,
        contents: Vec<u8>,
        mode: libc::mode_t,
    },
}

/// The descriptors the sandbox's processes use: the ends of the parent's pipes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fds {
    pub stdin: c_int,
    pub stdout: c_int,
    pub stderr: c_int,
    /// Init reads one byte from it once the parent has written its user and group maps.
    pub go: c_int,
    /// Where a failed setup step is reported (a [`Failure`]); close-on-exec, so a successful `execve`
    /// closes it.
    pub error: c_int,
    /// Where init writes the worker's wait status before it exits.
    pub status: c_int,
}

/// Everything the sandbox's processes need, prepared by the parent.
pub(super) struct Plan {
    pub steps: Vec<Step>,
    /// The staging folder: a tmpfs mounted there (step 0) becomes the new root.
    pub stage: CString,
    /// Mounts made read-only once the root is in place (`/`, `/dev`).
    pub read_only: Vec<CString>,
    pub hostname: CString,
    pub uid: libc::uid_t,
    pub gid: libc::gid_t,
    /// Whether supplementary groups can be (and are) dropped: when the parent is root. Otherwise the
    /// kernel forbids `setgroups` in the namespace.
    pub drop_groups: bool,
    pub program: CString,
    /// Null-terminated pointer arrays into C strings the plan owns.
    pub argv: Vec<*const c_char>,
    pub envp: Vec<*const c_char>,
    pub workdir: CString,
    pub rlimits: Vec<(libc::__rlimit_resource_t, libc::rlimit)>,
    pub filter: Vec<sock_filter>,
    pub fds: Fds,
    /// Stop right before `execve` (exit status 0): checks that every step works here.
    pub probe: bool,
}

/// What went wrong in the sandbox's setup, as written to the error pipe: the stage, the index of the
/// step or limit it concerns, and `errno`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(super) enum Stage {
    Identity = 1,
    Private,
    Step,
    Hostname,
    Pivot,
    ReadOnly,
    Fork,
    Stdio,
    Rlimit,
    Capabilities,
    NoNewPrivs,
    Seccomp,
    Workdir,
    Exec,
}

impl Stage {
    pub(super) fn from_code(code: u32) -> Option<Stage> {
        use Stage::*;
        [
            Identity,
            Private,
            Step,
            Hostname,
            Pivot,
            ReadOnly,
            Fork,
            Stdio,
            Rlimit,
            Capabilities,
            NoNewPrivs,
            Seccomp,
            Workdir,
            Exec,
        ]
        .into_iter()
        .find(|stage| *stage as u32 == code)
    }
}

/// The size of a failure record on the error pipe: stage, index, errno.
pub(super) const FAILURE_BYTES: usize = 12;

fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Writes a failure record and exits.
fn fail(fds: &Fds, stage: Stage, index: usize, errno: i32) -> ! {
    let mut record = [0u8; FAILURE_BYTES];
    record[..4].copy_from_slice(&(stage as u32).to_ne_bytes());
    record[4..8].copy_from_slice(&(index as u32).to_ne_bytes());
    record[8..].copy_from_slice(&errno.to_ne_bytes());
    // SAFETY: write(2) and _exit(2) of plain buffers; nothing else runs after.
    unsafe {
        libc::write(fds.error, record.as_ptr().cast(), record.len());
        libc::_exit(126)
    }
}

fn check(result: c_int, fds: &Fds, stage: Stage, index: usize) {
    if result < 0 {
        fail(fds, stage, index, errno());
    }
}

/// Restores the default action of every signal and unblocks them: the parent's handlers are no code
/// to run in here, and an ignored or blocked signal would leak into the program.
fn default_signals() {
    // SAFETY: sigaction/sigprocmask on this process only.
    unsafe {
        for signal in 1..libc::SIGRTMAX() {
            if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                libc::signal(signal, libc::SIG_DFL);
            }
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
    }
}

/// Closes every descriptor of this process except those in `keep`.
fn close_others(keep: &[c_int]) {
    // SAFETY: getrlimit/close on this process's own descriptors.
    unsafe {
        let mut limit: libc::rlimit = std::mem::zeroed();
        let highest = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur.min(1 << 20) as c_int
        } else {
            4096
        };
        let mut first = 0;
        let mut sorted = [c_int::MAX; 8];
        for (slot, fd) in sorted.iter_mut().zip(keep) {
            *slot = *fd;
        }
        sorted.sort_unstable();
        for &kept in sorted.iter().chain(std::iter::once(&c_int::MAX)) {
            let last = kept.min(highest);
            if first < last {
                // close_range(2) when the kernel has it (5.9), one by one otherwise.
                if libc::syscall(libc::SYS_close_range, first as u32, (last - 1) as u32, 0u32) != 0
                {
                    for fd in first..last {
                        libc::close(fd);
                    }
                }
            }
            if kept == c_int::MAX || kept >= highest {
                break;
            }
            first = kept + 1;
        }
    }
}

const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Makes every permitted capability effective (used by init: a change of uid may clear them).
fn raise_capabilities() -> c_int {
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget/capset with a version-3 header and two data words, as the ABI requires.
    unsafe {
        if libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) != 0 {
            return -1;
        }
        for word in &mut data {
            word.effective = word.permitted;
        }
        libc::syscall(libc::SYS_capset, &header, data.as_ptr()) as c_int
    }
}

/// Drops every capability: the bounding set, the ambient set, then permitted, effective and
/// inheritable.
fn drop_capabilities() -> c_int {
    // SAFETY: prctl/capset on this thread's own credentials.
    unsafe {
        for capability in 0..64 {
            // EINVAL past the last capability the kernel knows: nothing to drop there.
            libc::prctl(libc::PR_CAPBSET_DROP, capability, 0, 0, 0);
        }
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        );
        let header = CapHeader {
            version: CAPABILITY_VERSION_3,
            pid: 0,
        };
        let data = [CapData::default(); 2];
        libc::syscall(libc::SYS_capset, &header, data.as_ptr()) as c_int
    }
}

/// A plain `fork` as a system call: the C library's `fork` would run its at-fork handlers, which take
/// locks another thread of the parent may have held when it cloned.
fn raw_fork() -> libc::pid_t {
    // SAFETY: clone(2) without a new stack behaves as fork(2).
    unsafe {
        libc::syscall(
            libc::SYS_clone,
            libc::SIGCHLD as c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        ) as libc::pid_t
    }
}

fn run_step(step: &Step) -> c_int {
    // SAFETY: system calls on C strings the plan owns.
    unsafe {
        match step {
            Step::Dir(path) => {
                let result = libc::mkdir(path.as_ptr(), 0o755);
                if result < 0 && errno() == libc::EEXIST {
                    0
                } else {
                    result
                }
            }
            Step::File(path) => {
                let fd = libc::open(
                    path.as_ptr(),
                    libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                    0o644,
                );
                if fd < 0 {
                    return -1;
                }
                libc::close(fd)
            }
            Step::Symlink { target, path } => libc::symlink(target.as_ptr(), path.as_ptr()),
            Step::Bind {
                source,
                target,
                remount,
                ..
            } => {
                if libc::mount(
                    source.as_ptr(),
                    target.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND | libc::MS_REC,
                    std::ptr::null(),
                ) < 0
                {
                    return -1;
                }
                match remount {
                    Some(flags) => libc::mount(
                        std::ptr::null(),
                        target.as_ptr(),
                        std::ptr::null(),
                        *flags,
                        std::ptr::null(),
                    ),
                    None => 0,
                }
            }
            Step::Tmpfs { target, options } => libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                options.as_ptr().cast::<c_void>(),
            ),
            // hidepid=2: a process sees only the processes it could trace, so the code never sees
            // init, whose memory (command line, environment) is the caller's.
            Step::Proc(target) => libc::mount(
                c"proc".as_ptr(),
                target.as_ptr(),
                c"proc".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                c"hidepid=2".as_ptr().cast::<c_void>(),
            ),
            Step::Write {
                path,
                contents,
                mode,
            } => {
                let fd = libc::open(
                    path.as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC,
                    *mode as c_int,
                );
                if fd < 0 {
                    return -1;
                }
                let mut written = 0;
                while written < contents.len() {
                    let n = libc::write(
                        fd,
                        contents[written..].as_ptr().cast(),
                        contents.len() - written,
                    );
                    if n < 0 {
                        if errno() == libc::EINTR {
                            continue;
                        }
                        let saved = errno();
                        libc::close(fd);
                        *libc::__errno_location() = saved;
                        return -1;
                    }
                    written += n as usize;
                }
                libc::close(fd)
            }
        }
    }
}

/// The sandbox's init: PID 1 of the new PID namespace, with every capability inside the new user
/// namespace (none outside). Builds the root, starts the worker, waits for it, reports its status and
/// exits; its exit makes the kernel kill every other process of the namespace.
///
/// # Safety
/// Must run in the child of a `clone` with new user, PID and mount namespaces, and never return.
pub(super) unsafe fn init(plan: &Plan) -> ! {
    let fds = &plan.fds;
    // Die with the parent (a trainer that is killed leaves no sandbox behind).
    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as c_ulong, 0, 0, 0);
    default_signals();

    // Wait until the parent has written the user and group maps; end quietly if it gave up.
    let mut byte = 0u8;
    loop {
        let n = libc::read(fds.go, (&mut byte as *mut u8).cast(), 1);
        if n == 1 {
            break;
        }
        if n < 0 && errno() == libc::EINTR {
            continue;
        }
        libc::_exit(125);
    }

    // Open what will be bound while still the caller's user: the sandbox's user may not be allowed to
    // reach it (an interpreter under /root when the caller is root).
    for (index, step) in plan.steps.iter().enumerate() {
        if let Step::Bind { host, fd, .. } = step {
            let opened = libc::open(host.as_ptr(), libc::O_PATH | libc::O_CLOEXEC);
            if opened < 0 {
                fail(fds, Stage::Step, index, errno());
            }
            check(
                libc::dup3(opened, *fd, libc::O_CLOEXEC),
                fds,
                Stage::Step,
                index,
            );
            libc::close(opened);
        }
    }

    // Become the sandbox's unprivileged user while keeping the namespace's capabilities, so that files
    // init creates belong to a mapped user.
    // System calls, not the C library's wrappers: in a process the library believes multi-threaded,
    // those signal every other thread to change its ids too and wait for them, and the clone has
    // none of those threads.
    check(
        libc::syscall(libc::SYS_setresgid, plan.gid, plan.gid, plan.gid) as c_int,
        fds,
        Stage::Identity,
        0,
    );
    if plan.drop_groups {
        check(
            libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>()) as c_int,
            fds,
            Stage::Identity,
            1,
        );
    }
    check(
        libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0),
        fds,
        Stage::Identity,
        2,
    );
    check(
        libc::syscall(libc::SYS_setresuid, plan.uid, plan.uid, plan.uid) as c_int,
        fds,
        Stage::Identity,
        3,
    );
    check(raise_capabilities(), fds, Stage::Identity, 4);

    check(
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ),
        fds,
        Stage::Private,
        0,
    );
    for (index, step) in plan.steps.iter().enumerate() {
        check(run_step(step), fds, Stage::Step, index);
    }
    check(
        libc::sethostname(plan.hostname.as_ptr(), plan.hostname.as_bytes().len()),
        fds,
        Stage::Hostname,
        0,
    );
    // The staging folder becomes `/`; the host's root is detached and unreachable.
    check(libc::chdir(plan.stage.as_ptr()), fds, Stage::Pivot, 0);
    check(
        libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as c_int,
        fds,
        Stage::Pivot,
        1,
    );
    check(
        libc::umount2(c".".as_ptr(), libc::MNT_DETACH),
        fds,
        Stage::Pivot,
        2,
    );
    check(libc::chdir(c"/".as_ptr()), fds, Stage::Pivot, 3);
    for (index, path) in plan.read_only.iter().enumerate() {
        check(
            libc::mount(
                std::ptr::null(),
                path.as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT
                    | libc::MS_BIND
                    | libc::MS_RDONLY
                    | libc::MS_NOSUID
                    | libc::MS_NODEV,
                std::ptr::null(),
            ),
            fds,
            Stage::ReadOnly,
            index,
        );
    }
    // Nothing of the parent's descriptors stays in the sandbox but the pipes.
    close_others(&[fds.stdin, fds.stdout, fds.stderr, fds.error, fds.status]);

    let worker = raw_fork();
    if worker < 0 {
        fail(fds, Stage::Fork, 0, errno());
    }
    if worker == 0 {
        run_worker(plan);
    }
    libc::close(fds.stdin);
    libc::close(fds.stdout);
    libc::close(fds.stderr);
    libc::close(fds.error);
    // Reap whatever ends (orphans are re-parented to init) until the worker does.
    loop {
        let mut status: c_int = 0;
        let pid = libc::waitpid(-1, &mut status, 0);
        if pid == worker {
            let bytes = status.to_ne_bytes();
            libc::write(fds.status, bytes.as_ptr().cast(), bytes.len());
            libc::_exit(0);
        }
        if pid < 0 && errno() != libc::EINTR {
            libc::_exit(124);
        }
    }
}

/// The worker: the program's process. Takes the pipes as stdin/stdout/stderr, sets the limits, drops
/// every capability, forbids gaining privileges, installs the seccomp filter and executes the program.
unsafe fn run_worker(plan: &Plan) -> ! {
    let fds = &plan.fds;
    // Its own session and process group: the code's `kill(0, ...)` reaches only what it started.
    libc::setsid();
    for (index, (fd, target)) in [(fds.stdin, 0), (fds.stdout, 1), (fds.stderr, 2)]
        .into_iter()
        .enumerate()
    {
        check(libc::dup2(fd, target), fds, Stage::Stdio, index);
    }
    close_others(&[0, 1, 2, fds.error]);
    for (index, (resource, limit)) in plan.rlimits.iter().enumerate() {
        check(libc::setrlimit(*resource, limit), fds, Stage::Rlimit, index);
    }
    check(drop_capabilities(), fds, Stage::Capabilities, 0);
    check(
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0),
        fds,
        Stage::NoNewPrivs,
        0,
    );
    let program = libc::sock_fprog {
        len: plan.filter.len() as u16,
        filter: plan.filter.as_ptr() as *mut sock_filter,
    };
    check(
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER as c_ulong,
            &program as *const libc::sock_fprog as c_ulong,
            0,
            0,
        ),
        fds,
        Stage::Seccomp,
        0,
    );
    check(libc::chdir(plan.workdir.as_ptr()), fds, Stage::Workdir, 0);
    if plan.probe {
        libc::_exit(0);
    }
    libc::execve(
        plan.program.as_ptr(),
        plan.argv.as_ptr(),
        plan.envp.as_ptr(),
    );
    fail(fds, Stage::Exec, 0, errno());
}
