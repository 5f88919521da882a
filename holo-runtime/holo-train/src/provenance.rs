//! Provenance: what made a run, in `RUN_DIR/provenance.json`, so that every checkpoint can be traced to
//! the exact environment, data and model behind it, and `--resume` refuses to continue a run on changed
//! inputs (naming the file) unless told to (`--allow-changes`).
//!
//! A file is known by its SHA-256; a model folder by the SHA-256 of its files' names and contents in name
//! order (a `.gguf` file by its own). The configuration is the run's `config.toml`; the project's version
//! is holo-runtime's, which is also the version of the built-in holotypes.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The file a run folder keeps its provenance in.
pub const FILE: &str = "provenance.json";

/// An input of the run and its content hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hashed {
    /// What it is: `holoware`, `data`, `eval data`, `model`.
    pub role: String,
    /// The path as given.
    pub path: PathBuf,
    /// Hex SHA-256 of its content.
    pub sha256: String,
}

impl fmt::Display for Hashed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} `{}` ({})",
            self.role,
            self.path.display(),
            &self.sha256[..12.min(self.sha256.len())]
        )
    }
}

/// The build of `holo` that ran: what its code was made from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Build {
    /// The git commit of the sources, or `unknown` (not built from a git checkout).
    pub commit: String,
    /// Whether the sources differed from that commit (uncommitted or untracked changes); `None` when
    /// unknown.
    pub dirty: Option<bool>,
    /// Hex SHA-256 of the workspace's `Cargo.lock` (every dependency's exact version), or `unknown`.
    pub cargo_lock_sha256: String,
    /// The crates that define the holotypes a holoware can name, with their versions (`holo-core`: the
    /// built-in holotypes).
    pub holotypes: BTreeMap<String, String>,
}

impl Build {
    /// A build from `commit` (`unknown` when it was not a git checkout) and its dirty flag (`true`,
    /// `false`, `unknown`), with `cargo_lock` (empty when unknown) and the holotypes' crates.
    pub fn new(commit: &str, dirty: &str, cargo_lock: &[u8], holotypes: &[(&str, &str)]) -> Self {
        Build {
            commit: commit.to_string(),
            dirty: dirty.parse().ok(),
            cargo_lock_sha256: if cargo_lock.is_empty() {
                "unknown".into()
            } else {
                hex(&Sha256::digest(cargo_lock))
            },
            holotypes: holotypes
                .iter()
                .map(|(name, version)| (name.to_string(), version.to_string()))
                .collect(),
        }
    }
}

impl fmt::Display for Build {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let commit = &self.commit[..12.min(self.commit.len())];
        let dirty = match self.dirty {
            Some(true) => " with uncommitted changes",
            Some(false) => "",
            None => " (changes unknown)",
        };
        let lock = &self.cargo_lock_sha256[..12.min(self.cargo_lock_sha256.len())];
        write!(f, "commit {commit}{dirty}, Cargo.lock {lock}")
    }
}

/// What made a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provenance {
    /// holo-runtime's version: the trainer's and the built-in holotypes'.
    pub holo_runtime: String,
    /// The build that started the run (absent in runs made before builds were recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<Build>,
    /// The holoware, the data files and the model, in that order.
    pub inputs: Vec<Hashed>,
    /// Inputs a resumed run changed (`--allow-changes`), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<Change>,
}

/// A resume with changed inputs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// The checkpoint's step the run resumed from.
    pub step: u64,
    /// The inputs from then on.
    pub inputs: Vec<Hashed>,
    /// The build from then on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<Build>,
    /// What changed, in words.
    pub message: String,
}

impl Provenance {
    /// Hashes `inputs` (`(role, path)`: files, or model folders), with this build's version and `build`.
    pub fn collect(inputs: &[(&str, &Path)], build: Build) -> Result<Self, String> {
        let inputs = inputs
            .iter()
            .map(|(role, path)| {
                Ok(Hashed {
                    role: role.to_string(),
                    path: path.to_path_buf(),
                    sha256: hash_path(path)
                        .map_err(|error| format!("{role} `{}`: {error}", path.display()))?,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Provenance {
            holo_runtime: env!("CARGO_PKG_VERSION").to_string(),
            build: Some(build),
            inputs,
            changes: Vec::new(),
        })
    }

    /// Writes `run_dir/provenance.json`, replacing it atomically (a temporary file renamed over it): a
    /// kill while a resume records a change must not leave a file that the next resume cannot read.
    pub fn write(&self, run_dir: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        let staging = run_dir.join(format!("{FILE}.tmp"));
        std::fs::write(&staging, text + "\n")?;
        std::fs::rename(staging, run_dir.join(FILE))
    }

    /// Reads `run_dir/provenance.json`, if the run has one.
    pub fn read(run_dir: &Path) -> Result<Option<Self>, String> {
        let path = run_dir.join(FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|error| format!("`{}`: {error}", path.display())),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(format!("`{}`: {error}", path.display())),
        }
    }

    /// The build the run uses now: the last change's, or the one it started with.
    pub fn current_build(&self) -> Option<&Build> {
        self.changes
            .iter()
            .rev()
            .find_map(|change| change.build.as_ref())
            .or(self.build.as_ref())
    }

    /// How `now`'s build differs from the run's ([`Provenance::current_build`]), in words; `None` when
    /// they are the same, or the run recorded none.
    pub fn build_changed(&self, now: &Provenance) -> Option<String> {
        let (then, now) = (self.current_build()?, now.build.as_ref()?);
        (then != now).then(|| format!("the run was built from {then} and is resumed by {now}"))
    }

    /// The inputs the run uses now: the last change's, or those it started with.
    pub fn current(&self) -> &[Hashed] {
        self.changes
            .last()
            .map_or(&self.inputs, |change| &change.inputs)
    }

    /// The first difference between the run's recorded inputs ([`Provenance::current`]) and `now`'s, in
    /// words naming the input: a changed content, an input added or gone.
    pub fn changed(&self, now: &Provenance) -> Option<String> {
        for (then, now) in self.current().iter().zip(&now.inputs) {
            if then.role != now.role {
                break;
            }
            if then.sha256 != now.sha256 {
                return Some(format!(
                    "the {} changed since the run started: `{}` had SHA-256 {}, `{}` has {}",
                    then.role,
                    then.path.display(),
                    &then.sha256[..12],
                    now.path.display(),
                    &now.sha256[..12]
                ));
            }
        }
        let roles = |inputs: &[Hashed]| inputs.iter().map(|i| i.role.clone()).collect::<Vec<_>>();
        let (then, now) = (roles(self.current()), roles(&now.inputs));
        if then != now {
            return Some(format!(
                "the run was made from {} and is resumed with {}",
                then.join(", "),
                now.join(", ")
            ));
        }
        None
    }
}

/// A run folder as `holo runs` lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub dir: PathBuf,
    /// The last step in its `metrics.jsonl` (0 without one).
    pub steps: u64,
    /// The best `eval/reward` and its step.
    pub best_eval: Option<(u64, f64)>,
    pub provenance: Option<Provenance>,
}

/// The runs in `dir`: `dir` itself when it is a run folder (it has `metrics.jsonl` or
/// `provenance.json`), else its subfolders that are, by name.
pub fn runs(dir: &Path) -> Result<Vec<Run>, String> {
    let is_run = |path: &Path| {
        path.join(FILE).is_file() || path.join(super::metrics::METRICS_FILE).is_file()
    };
    let dirs: Vec<PathBuf> = if is_run(dir) {
        vec![dir.to_path_buf()]
    } else {
        let entries =
            std::fs::read_dir(dir).map_err(|error| format!("`{}`: {error}", dir.display()))?;
        let mut dirs: Vec<PathBuf> = entries
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .filter(|path| path.is_dir() && is_run(path))
            .collect();
        dirs.sort();
        dirs
    };
    dirs.into_iter()
        .map(|dir| {
            let metrics_path = dir.join(super::metrics::METRICS_FILE);
            let metrics = if metrics_path.is_file() {
                super::metrics::read_metrics(&metrics_path)?
            } else {
                Vec::new()
            };
            let steps = metrics.iter().map(|(step, _)| *step).max().unwrap_or(0);
            let best_eval = metrics
                .iter()
                .filter_map(|(step, values)| values.get("eval/reward").map(|value| (*step, *value)))
                .filter(|(_, value)| !value.is_nan())
                .fold(None, |best: Option<(u64, f64)>, (step, value)| match best {
                    Some((_, top)) if top >= value => best,
                    _ => Some((step, value)),
                });
            Ok(Run {
                provenance: Provenance::read(&dir)?,
                dir,
                steps,
                best_eval,
            })
        })
        .collect()
}

/// The SHA-256 of a file, or of a folder's files (names and contents, in name order; nested folders
/// included).
fn hash_path(path: &Path) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    if path.is_dir() {
        let mut files = Vec::new();
        collect_files(path, path, &mut files)?;
        files.sort();
        for relative in files {
            hasher.update(relative.to_string_lossy().as_bytes());
            hasher.update([0]);
            hash_file(&path.join(&relative), &mut hasher)?;
        }
    } else {
        hash_file(path, &mut hasher)?;
    }
    Ok(hex(&hasher.finalize()))
}

/// `bytes` in lowercase hexadecimal.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn collect_files(root: &Path, dir: &Path, files: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_files(root, &path, files)?;
        } else if let Ok(relative) = path.strip_prefix(root) {
            files.push(relative.to_path_buf());
        }
    }
    Ok(())
}

fn hash_file(path: &Path, hasher: &mut Sha256) -> std::io::Result<()> {
    let mut file = std::fs::File::open(path)?;
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let read = file.read(&mut buffer)?;
        if read == 0 {
            return Ok(());
        }
        hasher.update(&buffer[..read]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(commit: &str) -> Build {
        Build::new(commit, "false", b"[[package]]\n", &[("holo-core", "0.1.0")])
    }

    /// A build records its commit, dirty flag and lock file; another build resuming a run is a change
    /// in words, and a run recorded before builds were (no `build`) still reads and compares.
    #[test]
    fn builds_are_recorded_and_another_build_is_named() {
        let a = build("0123456789abcdef");
        assert_eq!(a.dirty, Some(false));
        assert_eq!(
            a.cargo_lock_sha256,
            hex(&Sha256::digest(b"[[package]]\n")),
            "the lock file's SHA-256"
        );
        let unknown = Build::new("unknown", "unknown", b"", &[]);
        assert_eq!(
            (unknown.dirty, unknown.cargo_lock_sha256.as_str()),
            (None, "unknown")
        );
        let then = Provenance::collect(&[], a.clone()).unwrap();
        assert_eq!(then.build_changed(&then), None);
        let dirty = Build::new("0123456789abcdef", "true", b"[[package]]\n", &[]);
        let now = Provenance::collect(&[], dirty).unwrap();
        let message = then.build_changed(&now).unwrap();
        assert!(
            message.contains("built from commit 0123456789ab, Cargo.lock")
                && message.contains("resumed by commit 0123456789ab with uncommitted changes"),
            "{message}"
        );
        // Once recorded as a change, the new build is the run's.
        let mut resumed = then.clone();
        resumed.changes.push(Change {
            step: 2,
            inputs: Vec::new(),
            build: now.build.clone(),
            message,
        });
        assert_eq!(resumed.build_changed(&now), None);

        let old = r#"{"holo_runtime": "0.1.0", "inputs": []}"#;
        let old: Provenance = serde_json::from_str(old).unwrap();
        assert_eq!((old.build.as_ref(), old.build_changed(&now)), (None, None));
    }

    #[test]
    fn a_changed_file_is_named_and_an_unchanged_run_passes() {
        let dir = std::env::temp_dir().join(format!("holo-provenance-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("model")).unwrap();
        let (hol, data) = (dir.join("a.hol"), dir.join("rows.jsonl"));
        std::fs::write(&hol, "<|o_o|>\nQ\n<|@_@|>\n").unwrap();
        std::fs::write(&data, "{}\n").unwrap();
        std::fs::write(dir.join("model/config.json"), "{}").unwrap();
        let inputs = [
            ("holoware", hol.as_path()),
            ("data", data.as_path()),
            ("model", dir.join("model").as_path()),
        ]
        .map(|(role, path)| (role, path.to_path_buf()));
        let refs: Vec<(&str, &Path)> = inputs.iter().map(|(r, p)| (*r, p.as_path())).collect();
        let then = Provenance::collect(&refs, build("a")).unwrap();
        assert_eq!(
            then.changed(&Provenance::collect(&refs, build("a")).unwrap()),
            None
        );
        std::fs::write(&data, "{\"x\": 1}\n").unwrap();
        let message = then
            .changed(&Provenance::collect(&refs, build("a")).unwrap())
            .unwrap();
        assert!(
            message.contains("data") && message.contains("rows.jsonl"),
            "{message}"
        );
        std::fs::write(dir.join("model/extra.bin"), "x").unwrap();
        let now = Provenance::collect(&refs, build("a")).unwrap();
        assert_ne!(
            then.inputs[2].sha256, now.inputs[2].sha256,
            "a new file in the model folder"
        );
        let fewer: Vec<(&str, &Path)> = refs[..2].to_vec();
        std::fs::write(&data, "{}\n").unwrap();
        let message = then
            .changed(&Provenance::collect(&fewer, build("a")).unwrap())
            .unwrap();
        assert!(message.contains("resumed with holoware, data"), "{message}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
