//! [`Limits`]: the resources one sandboxed run may use, with safe defaults.

use std::time::Duration;

const MIB: u64 = 1 << 20;

/// What one sandboxed run may use. Every field has a safe default ([`Limits::default`]); the
/// per-process limits are Linux resource limits (`setrlimit`), inherited by every process the code
/// starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Wall-clock limit of the whole run: when it passes, the sandbox's init process is killed and
    /// every process of the sandbox with it (default 5 s).
    pub timeout: Duration,
    /// CPU seconds each process may use (`RLIMIT_CPU`, default 10).
    pub cpu_seconds: u64,
    /// Address space of each process, in bytes (`RLIMIT_AS`, default 1 GiB).
    pub memory: u64,
    /// Processes (and threads) the sandbox's user may have at once (`RLIMIT_NPROC`, counted inside the
    /// sandbox's own user namespace; default 16).
    pub processes: u64,
    /// Largest file a process may write, in bytes (`RLIMIT_FSIZE`, default 16 MiB).
    pub file_size: u64,
    /// Open file descriptors per process (`RLIMIT_NOFILE`, default 256).
    pub open_files: u64,
    /// Size of the writable work folder, a `tmpfs` of its own, in bytes (default 64 MiB); also what
    /// all files written together may take.
    pub work_size: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout: Duration::from_secs(5),
            cpu_seconds: 10,
            memory: 1024 * MIB,
            processes: 16,
            file_size: 16 * MIB,
            open_files: 256,
            work_size: 64 * MIB,
        }
    }
}

impl Limits {
    /// Checks that every limit leaves room to start a program; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        let at_least = |name: &str, value: u64, minimum: u64, unit: &str| {
            if value < minimum {
                Err(format!(
                    "sandbox limit `{name}` must be at least {minimum}{unit}, found {value}"
                ))
            } else {
                Ok(())
            }
        };
        if self.timeout.is_zero() {
            return Err("sandbox limit `timeout` must be above 0 seconds".into());
        }
        at_least("cpu_seconds", self.cpu_seconds, 1, "")?;
        at_least("memory", self.memory / MIB, 16, " MiB")?;
        at_least("processes", self.processes, 1, "")?;
        at_least("file_size", self.file_size, 1, " byte")?;
        at_least("open_files", self.open_files, 8, "")?;
        at_least("work_size", self.work_size / MIB, 1, " MiB")?;
        Ok(())
    }

    /// The resource limits to set, as `(resource, value)` pairs for `setrlimit`.
    #[cfg(target_os = "linux")]
    pub(super) fn rlimits(&self) -> Vec<(libc::__rlimit_resource_t, libc::rlimit)> {
        let both = |value: u64| libc::rlimit {
            rlim_cur: value as libc::rlim_t,
            rlim_max: value as libc::rlim_t,
        };
        vec![
            // SIGXCPU at the soft limit (the program learns why it ends), SIGKILL a second later.
            (
                libc::RLIMIT_CPU,
                libc::rlimit {
                    rlim_cur: self.cpu_seconds as libc::rlim_t,
                    rlim_max: self.cpu_seconds.saturating_add(1) as libc::rlim_t,
                },
            ),
            (libc::RLIMIT_AS, both(self.memory)),
            (libc::RLIMIT_NPROC, both(self.processes)),
            (libc::RLIMIT_FSIZE, both(self.file_size)),
            (libc::RLIMIT_NOFILE, both(self.open_files)),
            // No core files: a crash would otherwise write the process's memory into the work folder.
            (libc::RLIMIT_CORE, both(0)),
            // Locked memory and message queues are not for sandboxed code.
            (libc::RLIMIT_MEMLOCK, both(0)),
            (libc::RLIMIT_MSGQUEUE, both(0)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_are_named() {
        assert_eq!(Limits::default().validate(), Ok(()));
        let error = Limits {
            processes: 0,
            ..Limits::default()
        }
        .validate()
        .unwrap_err();
        assert!(error.contains("`processes`"), "{error}");
        let error = Limits {
            memory: 1 << 20,
            ..Limits::default()
        }
        .validate()
        .unwrap_err();
        assert!(
            error.contains("`memory` must be at least 16 MiB"),
            "{error}"
        );
    }
}
