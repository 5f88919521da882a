//! Checkpoints on disk, so that a restarted server still has every one it saved: a training run's
//! folder holds what its LoRA adapter is (`run.json`), and each checkpoint a folder of its kind,
//!
//! ```text
//!  STORE/<run id>/run.json                                   base model, rank, seed, targets, alpha
//!  STORE/<run id>/weights/<name>/adapter.safetensors         save_state: the adapter,
//!                                optimizer.safetensors       AdamW's moments,
//!                                state.json                  and its step count
//!  STORE/<run id>/sampler_weights/<name>/adapter.safetensors save_weights_for_sampler
//! ```
//!
//! named by the `tinker://<run id>/<kind>/<name>` paths the SDK sends back. A checkpoint is written in
//! a staging folder renamed into place, so that a crash leaves either the whole checkpoint or none. A
//! checkpoint saved with a `ttl_seconds` holds `expires.json`; once that time has passed it is gone: the
//! store removes it when it next looks at it, and answers as if it had never been.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

/// What a training run's adapter is: enough to build it again over the base model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunInfo {
    pub base_model: String,
    pub rank: usize,
    pub alpha: f64,
    pub seed: u64,
    pub targets: Vec<String>,
}

/// The two kinds of checkpoint: a training state, or weights for sampling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Weights,
    Sampler,
}

impl Kind {
    pub fn folder(self) -> &'static str {
        match self {
            Kind::Weights => "weights",
            Kind::Sampler => "sampler_weights",
        }
    }
}

/// A checkpoint's address: `tinker://<run>/<kind>/<name>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CheckpointPath {
    pub run: String,
    pub kind: Kind,
    pub name: String,
}

impl CheckpointPath {
    /// Reads a `tinker://` path; `field` names where it came from in the error.
    pub fn parse(path: &str, field: &str) -> Result<Self, String> {
        let rest = path
            .strip_prefix("tinker://")
            .ok_or_else(|| format!("{field}: `{path}` does not start with tinker://"))?;
        let parts: Vec<&str> = rest.split('/').collect();
        let [run, kind, name] = parts[..] else {
            return Err(format!(
                "{field}: `{path}` is not tinker://<run>/weights/<name> or tinker://<run>/sampler_weights/<name>"
            ));
        };
        let kind = match kind {
            "weights" => Kind::Weights,
            "sampler_weights" => Kind::Sampler,
            other => {
                return Err(format!(
                    "{field}: `{path}`: `{other}` is neither weights nor sampler_weights"
                ))
            }
        };
        check_name(run, field)?;
        check_name(name, field)?;
        Ok(CheckpointPath {
            run: run.to_string(),
            kind,
            name: name.to_string(),
        })
    }

    pub fn uri(&self) -> String {
        format!("tinker://{}/{}/{}", self.run, self.kind.folder(), self.name)
    }
}

/// A run id or checkpoint name is one path component of letters, digits and `-_.:`, not `.` or `..`.
pub fn check_name(name: &str, field: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-_.:".contains(c);
    if name.is_empty() || name == "." || name == ".." || !name.chars().all(allowed) {
        return Err(format!(
            "{field}: `{name}` is not a name of letters, digits and -_.: (one path component)"
        ));
    }
    Ok(())
}

/// A loaded training state.
pub struct Loaded {
    pub adapter: HashMap<String, Tensor>,
    /// AdamW's moments and step count, when the checkpoint is a training state.
    pub optimizer: Option<(u64, HashMap<String, Tensor>)>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StepState {
    step: u64,
}

/// When a checkpoint saved with a TTL expires, in seconds since the Unix epoch.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Expiry {
    expires_at: u64,
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// The store folder.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

fn other(error: impl std::fmt::Display) -> io::Error {
    io::Error::other(error.to_string())
}

impl Store {
    pub fn open(root: impl Into<PathBuf>) -> io::Result<Self> {
        let root = root.into();
        fs::create_dir_all(&root)?;
        Ok(Store { root })
    }

    fn run_dir(&self, run: &str) -> PathBuf {
        self.root.join(run)
    }

    fn dir(&self, path: &CheckpointPath) -> PathBuf {
        self.run_dir(&path.run)
            .join(path.kind.folder())
            .join(&path.name)
    }

    /// Records a run's adapter (once, when it is created).
    pub fn create_run(&self, run: &str, info: &RunInfo) -> io::Result<()> {
        let dir = self.run_dir(run);
        fs::create_dir_all(&dir)?;
        write_json(&dir.join("run.json"), info)
    }

    pub fn run_info(&self, run: &str) -> Result<RunInfo, String> {
        let path = self.run_dir(run).join("run.json");
        let text = fs::read_to_string(&path)
            .map_err(|error| format!("training run `{run}` is not in the store: {error}"))?;
        serde_json::from_str(&text).map_err(|error| format!("{}: {error}", path.display()))
    }

    pub fn exists(&self, path: &CheckpointPath) -> bool {
        self.live(&self.dir(path))
    }

    /// Whether the checkpoint folder `dir` is there and not expired; an expired one is removed.
    fn live(&self, dir: &Path) -> bool {
        if !dir.is_dir() {
            return false;
        }
        let expiry = fs::read_to_string(dir.join("expires.json"))
            .ok()
            .and_then(|text| serde_json::from_str::<Expiry>(&text).ok());
        match expiry {
            Some(expiry) if expiry.expires_at <= now() => {
                let _ = fs::remove_dir_all(dir);
                false
            }
            _ => true,
        }
    }

    /// Writes a checkpoint: `adapter` and, for a training state, the optimizer's `moments` at `step`;
    /// it expires `ttl_seconds` from now when given. An existing checkpoint of that path is replaced
    /// only with `overwrite`.
    pub fn save(
        &self,
        path: &CheckpointPath,
        adapter: Vec<(String, Tensor)>,
        optimizer: Option<(u64, Vec<(String, Tensor)>)>,
        overwrite: bool,
        ttl_seconds: Option<u64>,
    ) -> io::Result<()> {
        let dir = self.dir(path);
        if self.live(&dir) && !overwrite {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists (overwrite is false)", path.uri()),
            ));
        }
        let parent = dir.parent().expect("a checkpoint folder has a parent");
        fs::create_dir_all(parent)?;
        let staging = parent.join(format!(".{}.{}.tmp", path.name, std::process::id()));
        if staging.exists() {
            fs::remove_dir_all(&staging)?;
        }
        fs::create_dir_all(&staging)?;
        holo_train::checkpoint::save_tensors(&staging.join("adapter.safetensors"), adapter)?;
        if let Some((step, moments)) = optimizer {
            holo_train::checkpoint::save_tensors(&staging.join("optimizer.safetensors"), moments)?;
            write_json(&staging.join("state.json"), &StepState { step })?;
        }
        if let Some(ttl) = ttl_seconds {
            let expires_at = now().saturating_add(ttl);
            write_json(&staging.join("expires.json"), &Expiry { expires_at })?;
        }
        if dir.exists() {
            fs::remove_dir_all(&dir)?;
        }
        fs::rename(&staging, &dir)?;
        fs::File::open(parent)?.sync_all()
    }

    /// Reads a checkpoint onto `device`.
    pub fn load(&self, path: &CheckpointPath, device: &Device) -> Result<Loaded, String> {
        let dir = self.dir(path);
        if !self.live(&dir) {
            return Err(format!("checkpoint {} does not exist", path.uri()));
        }
        let read = |file: &str| {
            candle_core::safetensors::load(dir.join(file), device)
                .map_err(|error| format!("{}: {file}: {error}", path.uri()))
        };
        let adapter = read("adapter.safetensors")?;
        let optimizer = if dir.join("state.json").is_file() {
            let text = fs::read_to_string(dir.join("state.json")).map_err(|e| e.to_string())?;
            let state: StepState = serde_json::from_str(&text)
                .map_err(|error| format!("{}: state.json: {error}", path.uri()))?;
            Some((state.step, read("optimizer.safetensors")?))
        } else {
            None
        };
        Ok(Loaded { adapter, optimizer })
    }

    /// The checkpoints of `run`, training states first, each kind by name.
    pub fn list(&self, run: &str) -> io::Result<Vec<CheckpointPath>> {
        let mut found = Vec::new();
        for kind in [Kind::Weights, Kind::Sampler] {
            let dir = self.run_dir(run).join(kind.folder());
            let Ok(entries) = fs::read_dir(&dir) else {
                continue;
            };
            let mut names: Vec<String> = entries
                .filter_map(|entry| entry.ok())
                .filter(|entry| self.live(&entry.path()))
                .filter_map(|entry| entry.file_name().into_string().ok())
                .filter(|name| !name.starts_with('.'))
                .collect();
            names.sort();
            found.extend(names.into_iter().map(|name| CheckpointPath {
                run: run.to_string(),
                kind,
                name,
            }));
        }
        Ok(found)
    }

    /// When a checkpoint was written, in seconds since the Unix epoch.
    pub fn written(&self, path: &CheckpointPath) -> io::Result<u64> {
        let modified = fs::metadata(self.dir(path))?.modified()?;
        Ok(modified
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_secs()))
    }

    /// Deletes a checkpoint; `false` when there was none.
    pub fn delete(&self, path: &CheckpointPath) -> io::Result<bool> {
        let dir = self.dir(path);
        if !self.live(&dir) {
            return Ok(false);
        }
        fs::remove_dir_all(dir)?;
        Ok(true)
    }
}

fn write_json(path: &Path, value: &impl Serialize) -> io::Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(other)?;
    let staging = path.with_extension("json.tmp");
    fs::write(&staging, text)?;
    fs::File::open(&staging)?.sync_all()?;
    fs::rename(staging, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint whose TTL has passed is gone for every question the store answers.
    #[test]
    fn an_expired_checkpoint_is_gone() {
        let root = std::env::temp_dir().join(format!("holo-tinker-store-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let store = Store::open(&root).unwrap();
        let adapter = || {
            vec![(
                "a".to_string(),
                Tensor::zeros(2, candle_core::DType::F32, &Device::Cpu).unwrap(),
            )]
        };
        let path = |name: &str| {
            CheckpointPath::parse(&format!("tinker://run/weights/{name}"), "path").unwrap()
        };
        store
            .save(
                &path("lasting"),
                adapter(),
                Some((3, adapter())),
                false,
                Some(3600),
            )
            .unwrap();
        store
            .save(
                &path("expired"),
                adapter(),
                Some((3, adapter())),
                false,
                Some(0),
            )
            .unwrap();
        assert!(store.exists(&path("lasting")));
        assert!(!store.exists(&path("expired")));
        assert!(store.load(&path("expired"), &Device::Cpu).is_err());
        assert_eq!(store.list("run").unwrap(), vec![path("lasting")]);
        assert!(
            !root.join("run/weights/expired").exists(),
            "removed when seen expired"
        );
        // Saving again under an expired name needs no overwrite.
        store
            .save(&path("expired"), adapter(), None, false, None)
            .unwrap();
        assert!(store.exists(&path("expired")));
        let loaded = store.load(&path("lasting"), &Device::Cpu).unwrap();
        assert_eq!(loaded.optimizer.map(|(step, _)| step), Some(3));
        assert!(store
            .save(&path("lasting"), adapter(), None, false, None)
            .is_err());
        fs::remove_dir_all(&root).unwrap();
    }
}
