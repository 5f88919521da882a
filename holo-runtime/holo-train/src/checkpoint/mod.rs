//! Checkpoints: everything a run needs to go on exactly where it stopped.
//!
//! `RUN_DIR/checkpoint-N/` (after `N` optimizer steps) holds:
//! - `model.safetensors` (full fine-tuning: every trained weight under its Hugging Face name), or
//!   `adapter_model.safetensors` + `adapter_config.json` (LoRA, PEFT's layout);
//! - `value_model.safetensors` (PPO): the value model's trained weights (or adapters) and its head
//!   `score.weight`;
//! - `optimizer.safetensors` (unless `save_only_model`): AdamW's moments (`<weight>.exp_avg`, `<weight>.exp_avg_sq`; the value
//!   model's under `value_model.<weight>`) and the f32 master copies of bf16 weights (`<weight>.master`);
//! - `trainer_state.json`: the step, the generations drawn (the data position and every seed derive from
//!   it), the tokens seen, the generation batch still being trained on when `num_iterations` or
//!   `steps_per_generation` spread one generation over several steps, the curriculum's level and window,
//!   and the guard rails' state;
//! - `config.toml`: the run's options, which a resumed run must repeat;
//! - `checksums.json`: the CRC-32C of every other file, checked when the checkpoint is read back (a
//!   damaged file is refused, naming it).
//!
//! A checkpoint is written into a temporary folder beside its final name, each file synced, and renamed
//! into place: a run killed at any moment leaves either the whole checkpoint or none (a leftover temporary
//! folder is removed by the next save or resume). Only the newest `save_total_limit` are kept; a checkpoint
//! is removed by renaming it to a temporary folder first, so a removal cut short leaves no `checkpoint-N`
//! missing files either. `tests/kill/` kills runs inside these writes (the points of [`super::kill`]).

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use super::config::TrainingConfig;
pub use super::state::{Buffer, TrainerState};

#[cfg(feature = "local")]
mod tensors;

#[cfg(feature = "local")]
pub use tensors::{load, restore, save, save_tensors, Loaded, Weights};

/// Where a run's files are.
#[derive(Debug, Clone)]
pub struct RunDir {
    pub path: PathBuf,
}

impl RunDir {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        RunDir { path: path.into() }
    }

    pub fn checkpoint(&self, step: u64) -> PathBuf {
        self.path.join(format!("checkpoint-{step}"))
    }

    /// The complete checkpoints, oldest first, with their steps.
    pub fn checkpoints(&self) -> io::Result<Vec<(u64, PathBuf)>> {
        let mut found = Vec::new();
        let entries = match fs::read_dir(&self.path) {
            Ok(entries) => entries,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(found),
            Err(error) => return Err(error),
        };
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name();
            let Some(step) = name
                .to_str()
                .and_then(|name| name.strip_prefix("checkpoint-"))
                .and_then(|step| step.parse::<u64>().ok())
            else {
                continue;
            };
            if entry.path().join("trainer_state.json").is_file() {
                found.push((step, entry.path()));
            }
        }
        found.sort();
        Ok(found)
    }

    /// Removes the checkpoints after `step` (a rollback abandons them).
    pub fn remove_after(&self, step: u64) -> io::Result<()> {
        for (n, dir) in self.checkpoints()?.into_iter().filter(|(n, _)| *n > step) {
            self.remove_checkpoint(n, &dir)?;
        }
        Ok(())
    }

    /// Removes the oldest checkpoints beyond the newest `keep` (all are kept without a limit).
    pub fn prune(&self, keep: Option<usize>) -> io::Result<()> {
        let Some(keep) = keep else {
            return Ok(());
        };
        let all = self.checkpoints()?;
        for (step, dir) in all.iter().take(all.len().saturating_sub(keep)) {
            self.remove_checkpoint(*step, dir)?;
        }
        Ok(())
    }

    /// Removes checkpoint `dir` of `step` as a whole: renamed out of the checkpoints' names first, so that a
    /// kill in the middle of the removal leaves a temporary folder (removed by [`RunDir::remove_partial`])
    /// rather than a `checkpoint-N` that lacks some of its files.
    pub fn remove_checkpoint(&self, step: u64, dir: &Path) -> io::Result<()> {
        let doomed = self.path.join(format!(".checkpoint-{step}-removed.tmp"));
        fs::rename(dir, &doomed)?;
        super::kill::point("checkpoint:removing");
        fs::remove_dir_all(doomed)
    }

    /// Drops the records of steps after `step` from the rollout file `name` (a resumed or rolled back
    /// run writes them again), replacing it atomically.
    pub fn keep_records_until(&self, name: &str, step: u64) -> io::Result<()> {
        let path = self.path.join(name);
        let Ok(text) = fs::read_to_string(&path) else {
            return Ok(());
        };
        let mut kept = String::with_capacity(text.len());
        for line in text.split_inclusive('\n') {
            if !line.ends_with('\n') {
                break;
            }
            let record_step = serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|value| value.get("step").and_then(serde_json::Value::as_u64));
            if record_step.is_some_and(|record_step| record_step <= step) {
                kept.push_str(line);
            }
        }
        let staging = path.with_extension("jsonl.resume");
        fs::write(&staging, kept)?;
        super::kill::point("records:staged");
        fs::rename(staging, path)
    }

    /// Removes temporary folders a killed save or removal left.
    pub fn remove_partial(&self) -> io::Result<()> {
        let Ok(entries) = fs::read_dir(&self.path) else {
            return Ok(());
        };
        for entry in entries {
            let entry = entry?;
            if entry
                .file_name()
                .to_str()
                .is_some_and(|name| name.starts_with(".checkpoint-") && name.ends_with(".tmp"))
            {
                fs::remove_dir_all(entry.path())?;
            }
        }
        Ok(())
    }
}

fn other(error: impl std::fmt::Display) -> io::Error {
    io::Error::other(error.to_string())
}

fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = fs::File::create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// The file of a checkpoint that holds the optimizer's state.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// The file of a checkpoint that holds PPO's value model.
pub const CRITIC_FILE: &str = "value_model.safetensors";

/// The file of a checkpoint that holds the CRC-32C of each of its other files.
pub const CHECKSUMS_FILE: &str = "checksums.json";

/// The CRC-32C of the file at `path`, read in blocks.
fn file_crc(path: &Path) -> io::Result<u32> {
    use std::io::Read;
    let mut file = fs::File::open(path)?;
    let mut block = vec![0u8; 1 << 20];
    let mut crc = 0;
    loop {
        let read = file.read(&mut block)?;
        if read == 0 {
            return Ok(crc);
        }
        crc = crc32c::crc32c_append(crc, &block[..read]);
    }
}

/// Writes `dir/checksums.json`: the CRC-32C of every other file of `dir`, by name. A checkpoint is read
/// back only if its files still have them ([`verify`]): a flipped bit in a weight file parses, and
/// would resume a run from other weights without a word.
pub fn write_checksums(dir: &Path) -> io::Result<()> {
    let mut sums = std::collections::BTreeMap::new();
    for entry in fs::read_dir(dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name != CHECKSUMS_FILE {
            sums.insert(name.clone(), format!("{:08x}", file_crc(&dir.join(&name))?));
        }
    }
    let text = serde_json::to_string_pretty(&sums).map_err(other)?;
    write_synced(&dir.join(CHECKSUMS_FILE), text.as_bytes())
}

/// Checks the files of `dir` (a `checkpoint-N` folder) that `wanted` accepts against its
/// `checksums.json`: an error names a file that is missing or whose CRC-32C changed. A checkpoint
/// written before checksums were kept has none, and passes.
pub fn verify(dir: &Path, wanted: impl Fn(&str) -> bool) -> Result<(), String> {
    let path = dir.join(CHECKSUMS_FILE);
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(format!("{}: {error}", path.display())),
    };
    let sums: std::collections::BTreeMap<String, String> =
        serde_json::from_str(&text).map_err(|error| format!("{}: {error}", path.display()))?;
    for (name, recorded) in sums.iter().filter(|(name, _)| wanted(name)) {
        let file = dir.join(name);
        let crc = file_crc(&file).map_err(|error| format!("{}: {error}", file.display()))?;
        if format!("{crc:08x}") != *recorded {
            return Err(format!(
                "{}: the file is damaged (CRC-32C {crc:08x}, the checkpoint recorded {recorded})",
                file.display()
            ));
        }
    }
    Ok(())
}

/// The trainer state and configuration of `dir` (a `checkpoint-N` folder), whatever holds its weights;
/// both files are checked against the checkpoint's checksums first.
pub fn read_state<C: serde::de::DeserializeOwned>(dir: &Path) -> Result<(TrainerState, C), String> {
    verify(dir, |name| {
        name == "trainer_state.json" || name == "config.toml"
    })?;
    let name = dir.display();
    let read = |file: &str| {
        fs::read_to_string(dir.join(file)).map_err(|error| format!("{name}/{file}: {error}"))
    };
    let state: TrainerState = serde_json::from_str(&read("trainer_state.json")?)
        .map_err(|error| format!("{name}/trainer_state.json: {error}"))?;
    let config: C = toml::from_str(&read("config.toml")?)
        .map_err(|error| format!("{name}/config.toml: {}", error.message()))?;
    Ok((state, config))
}

/// PEFT's `adapter_config.json` for adapters of `config` on the model at `base`.
pub fn adapter_config(config: &impl TrainingConfig, base: &str) -> serde_json::Value {
    let config = config.training();
    serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": config.lora_r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": config.lora_targets(),
        "target_parameters": config.lora_target_parameters,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": null
    })
}
