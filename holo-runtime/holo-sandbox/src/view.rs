//! What the sandbox sees of the file system, as the steps init runs: a fresh root holding read-only
//! binds of the system's programs and libraries (`/usr`, `/lib*`, `/bin`, `/sbin`), of the paths the
//! caller exposes (an interpreter's prefix), `/etc/ld.so.cache`, a minimal `/dev`, a fresh `/proc` of
//! the sandbox's PID namespace, a generated `/etc/passwd`, and the writable work folder `/tmp`, a
//! size-capped tmpfs holding the job's files. Nothing else of the host: no home, no project, no run
//! folder, no host `/proc`.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::child::Step;
use super::limits::Limits;

/// Where init mounts the new root before it pivots into it. The path is the host's (an existing
/// folder), but the mount lives in the sandbox's own mount namespace, so the host never sees it; the
/// sources of binds are opened beforehand, so a source under it is not hidden.
const STAGE: &str = "/tmp";

/// The work folder inside the sandbox: the working directory, `HOME` and `TMPDIR`.
pub const WORKDIR: &str = "/tmp";

/// The host's system folders, bound read-only (or recreated as the same symlink) when they exist.
const SYSTEM: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];

/// Host files bound read-only when they exist: the dynamic loader's cache (libraries are found without
/// it, but slower).
const SYSTEM_FILES: &[&str] = &["/etc/ld.so.cache"];

/// Device nodes bound from the host's `/dev`.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom"];

/// The steps, the descriptors their binds read from (they must stay open until init ran), and the
/// mounts made read-only after the pivot.
pub(super) struct Built {
    pub steps: Vec<Step>,
    pub sources: Vec<OwnedFd>,
    pub read_only: Vec<CString>,
    pub stage: CString,
}

fn c_path(path: &Path) -> Result<CString, String> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| format!("the path {} contains a NUL byte", path.display()))
}

/// `STAGE` + `path` (absolute).
fn staged(path: &Path) -> Result<CString, String> {
    let relative = path.strip_prefix("/").unwrap_or(path);
    c_path(&Path::new(STAGE).join(relative))
}

/// Opens `path` as an `O_PATH` descriptor (no access to its contents, only a handle to bind).
fn open_path(path: &Path) -> Result<OwnedFd, String> {
    let c = c_path(path)?;
    // SAFETY: open(2) of a C string; the descriptor is owned by the returned value.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(format!(
            "cannot open {} for the sandbox: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: a fresh descriptor this function owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Mount flags (`MS_*`) of the mount holding `path` that a user namespace may not clear, to keep on
/// a read-only remount of its bind.
fn locked_flags(path: &Path) -> Result<libc::c_ulong, String> {
    let c = c_path(path)?;
    // SAFETY: statvfs(3) into a zeroed struct.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut stat) } != 0 {
        return Err(format!(
            "cannot inspect {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    let mut flags = 0;
    for (st, ms) in [
        (libc::ST_NOEXEC, libc::MS_NOEXEC),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
    ] {
        if stat.f_flag & st != 0 {
            flags |= ms;
        }
    }
    Ok(flags)
}

/// Builds the steps for a sandbox exposing `exposed` (host paths, read-only) with the job's `files`
/// (name, contents) in the work folder.
pub(super) fn build(
    exposed: &[PathBuf],
    files: &[(String, Vec<u8>)],
    limits: &Limits,
    uid: u32,
    gid: u32,
) -> Result<Built, String> {
    let mut steps = vec![Step::Tmpfs {
        target: c_path(Path::new(STAGE))?,
        options: CString::new("mode=0755,size=4m,nr_inodes=4096").expect("no NUL"),
    }];
    let mut sources = Vec::new();
    let mut made: BTreeSet<PathBuf> = BTreeSet::new();
    made.insert(PathBuf::from("/"));

    // What to bind: the system folders (or their symlinks), then the exposed paths, each once and
    // never below one already bound.
    let mut binds: Vec<PathBuf> = Vec::new();
    for folder in SYSTEM {
        let path = Path::new(folder);
        match std::fs::symlink_metadata(path) {
            Ok(metadata) if metadata.file_type().is_symlink() => {
                let target = std::fs::read_link(path)
                    .map_err(|error| format!("cannot read the link {folder}: {error}"))?;
                steps.push(Step::Symlink {
                    target: c_path(&target)?,
                    path: staged(path)?,
                });
                made.insert(path.to_path_buf());
            }
            Ok(metadata) if metadata.is_dir() => binds.push(path.to_path_buf()),
            _ => {}
        }
    }
    for file in SYSTEM_FILES {
        if Path::new(file).is_file() {
            binds.push(PathBuf::from(file));
        }
    }
    for path in exposed {
        let canonical = path
            .canonicalize()
            .map_err(|error| format!("cannot expose {} to the sandbox: {error}", path.display()))?;
        binds.push(canonical);
    }
    binds.sort();
    binds.dedup();
    let mut bound: Vec<PathBuf> = Vec::new();
    for path in binds {
        if bound.iter().any(|outer| path.starts_with(outer)) {
            continue;
        }
        if path == Path::new("/") {
            return Err("the sandbox cannot expose the whole file system (`/`)".into());
        }
        for ancestor in path.ancestors().collect::<Vec<_>>().into_iter().rev() {
            if ancestor == path || made.contains(ancestor) {
                continue;
            }
            steps.push(Step::Dir(staged(ancestor)?));
            made.insert(ancestor.to_path_buf());
        }
        let is_dir = path.is_dir();
        steps.push(if is_dir {
            Step::Dir(staged(&path)?)
        } else {
            Step::File(staged(&path)?)
        });
        let fd = open_path(&path)?;
        steps.push(Step::Bind {
            host: c_path(&path)?,
            fd: fd.as_raw_fd(),
            source: CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).expect("no NUL"),
            target: staged(&path)?,
            remount: Some(
                libc::MS_BIND
                    | libc::MS_REMOUNT
                    | libc::MS_RDONLY
                    | libc::MS_NOSUID
                    | libc::MS_NODEV
                    | locked_flags(&path)?,
            ),
        });
        sources.push(fd);
        made.insert(path.clone());
        bound.push(path);
    }

    // /dev: a small tmpfs with the harmless devices bound from the host, and the usual links.
    let dev = Path::new("/dev");
    if !made.contains(dev) {
        steps.push(Step::Dir(staged(dev)?));
    }
    steps.push(Step::Tmpfs {
        target: staged(dev)?,
        options: CString::new("mode=0755,size=64k,nr_inodes=64").expect("no NUL"),
    });
    for device in DEVICES {
        let path = dev.join(device);
        let fd = open_path(&path)?;
        steps.push(Step::File(staged(&path)?));
        steps.push(Step::Bind {
            host: c_path(&path)?,
            fd: fd.as_raw_fd(),
            source: CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).expect("no NUL"),
            target: staged(&path)?,
            remount: None,
        });
        sources.push(fd);
    }
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        steps.push(Step::Symlink {
            target: CString::new(target).expect("no NUL"),
            path: staged(&dev.join(name))?,
        });
    }

    let proc = Path::new("/proc");
    steps.push(Step::Dir(staged(proc)?));
    steps.push(Step::Proc(staged(proc)?));

    // /etc: only a passwd and group naming the sandbox's user (and the loader's cache bound above).
    let etc = Path::new("/etc");
    if !made.contains(etc) {
        steps.push(Step::Dir(staged(etc)?));
    }
    steps.push(Step::Write {
        path: staged(&etc.join("passwd"))?,
        contents: format!("sandbox:x:{uid}:{gid}:sandbox:{WORKDIR}:/bin/sh\n").into_bytes(),
        mode: 0o644,
    });
    steps.push(Step::Write {
        path: staged(&etc.join("group"))?,
        contents: format!("sandbox:x:{gid}:\n").into_bytes(),
        mode: 0o644,
    });

    // The work folder, its size and file count capped, with the job's files.
    let work = Path::new(WORKDIR);
    steps.push(Step::Dir(staged(work)?));
    let inodes = (limits.work_size / 4096).clamp(64, 1 << 20);
    steps.push(Step::Tmpfs {
        target: staged(work)?,
        options: CString::new(format!(
            "mode=0700,size={},nr_inodes={inodes}",
            limits.work_size
        ))
        .expect("no NUL"),
    });
    for (name, contents) in files {
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(format!(
                "a sandbox input file needs a plain file name (no `/`), found `{name}`"
            ));
        }
        steps.push(Step::Write {
            path: staged(&work.join(name))?,
            contents: contents.clone(),
            mode: 0o644,
        });
    }
    Ok(Built {
        steps,
        sources,
        read_only: vec![
            CString::new("/").expect("no NUL"),
            CString::new("/dev").expect("no NUL"),
        ],
        stage: c_path(Path::new(STAGE))?,
    })
}
