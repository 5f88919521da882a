//! Provenance: what made a run, in `RUN_DIR/provenance.json`, so that every checkpoint can be traced to
//! the exact environment, data and model behind it, and `--resume` refuses to continue a run on changed
//! inputs (naming the file) unless told to (`--allow-changes`).
//!
//! A file is known by its SHA-256; a model folder by the SHA-256 of its files' names and contents in name
//! order (a `.gguf` file by its own). The configuration is the run's `config.toml`; the project's version
//! is holo-runtime's, which is also the version of the built-in holotypes.

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

/// What made a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provenance {
    /// holo-runtime's version: the trainer's and the built-in holotypes'.
    pub holo_runtime: String,
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
    /// What changed, in words.
    pub message: String,
}

impl Provenance {
    /// Hashes `inputs` (`(role, path)`: files, or model folders), with this build's version.
    pub fn collect(inputs: &[(&str, &Path)]) -> Result<Self, String> {
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
            inputs,
            changes: Vec::new(),
        })
    }

    /// Writes `run_dir/provenance.json`.
    pub fn write(&self, run_dir: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(run_dir.join(FILE), text + "\n")
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
    Ok(hasher
        .finalize()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect())
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
        let then = Provenance::collect(&refs).unwrap();
        assert_eq!(then.changed(&Provenance::collect(&refs).unwrap()), None);
        std::fs::write(&data, "{\"x\": 1}\n").unwrap();
        let message = then.changed(&Provenance::collect(&refs).unwrap()).unwrap();
        assert!(
            message.contains("data") && message.contains("rows.jsonl"),
            "{message}"
        );
        std::fs::write(dir.join("model/extra.bin"), "x").unwrap();
        let now = Provenance::collect(&refs).unwrap();
        assert_ne!(
            then.inputs[2].sha256, now.inputs[2].sha256,
            "a new file in the model folder"
        );
        let fewer: Vec<(&str, &Path)> = refs[..2].to_vec();
        std::fs::write(&data, "{}\n").unwrap();
        let message = then.changed(&Provenance::collect(&fewer).unwrap()).unwrap();
        assert!(message.contains("resumed with holoware, data"), "{message}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
