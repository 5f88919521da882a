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

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use candle_core::{Tensor, Var};

use super::config::TrainingConfig;
use super::optim::StateTensor;
pub use super::state::{Buffer, TrainerState};

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

/// The trained weights of a checkpoint.
pub enum Weights<'a> {
    /// Every trained weight by Hugging Face name.
    Full(&'a [(String, Var)]),
    /// LoRA adapters under PEFT's names, and the `adapter_config.json` to write beside them.
    Adapters {
        vars: &'a [(String, Var)],
        adapter_config: serde_json::Value,
    },
}

fn other(error: impl std::fmt::Display) -> io::Error {
    io::Error::other(error.to_string())
}

fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = fs::File::create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// Writes `tensors` as a safetensors file, synced, readable by others (safetensors writes through a
/// private temporary file, which would leave the file readable by its owner only).
pub fn save_tensors(path: &Path, tensors: Vec<(String, impl safetensors::View)>) -> io::Result<()> {
    safetensors::serialize_to_file(tensors, None, path).map_err(other)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(path, fs::Permissions::from_mode(0o644))?;
    }
    fs::File::open(path)?.sync_all()
}

/// Writes `checkpoint-<state.global_step>` atomically, then removes the oldest beyond `keep`.
pub fn save(
    run: &RunDir,
    weights: &Weights<'_>,
    critic: Option<&[(String, Var)]>,
    optimizer: Option<Vec<(String, StateTensor<'_>)>>,
    state: &TrainerState,
    config: &impl TrainingConfig,
    keep: Option<usize>,
) -> io::Result<PathBuf> {
    run.remove_partial()?;
    let step = state.global_step;
    let staging = run
        .path
        .join(format!(".checkpoint-{step}-{}.tmp", std::process::id()));
    fs::create_dir_all(&staging)?;
    // The named points let tests/kill/ stop the process at each stage of the write (`HOLO_KILL_AT`).
    super::kill::point("checkpoint:staging");
    match weights {
        Weights::Full(vars) => save_tensors(
            &staging.join("model.safetensors"),
            vars.iter()
                .map(|(name, var)| (name.clone(), var.as_tensor().clone()))
                .collect(),
        )?,
        Weights::Adapters {
            vars,
            adapter_config,
        } => {
            save_tensors(
                &staging.join("adapter_model.safetensors"),
                vars.iter()
                    .map(|(name, var)| (name.clone(), var.as_tensor().clone()))
                    .collect(),
            )?;
            let text = serde_json::to_string_pretty(adapter_config).map_err(other)?;
            write_synced(&staging.join("adapter_config.json"), text.as_bytes())?;
        }
    }
    super::kill::point("checkpoint:weights");
    if let Some(critic) = critic {
        save_tensors(
            &staging.join(CRITIC_FILE),
            critic
                .iter()
                .map(|(name, var)| (name.clone(), var.as_tensor().clone()))
                .collect(),
        )?;
        super::kill::point("checkpoint:critic");
    }
    if let Some(optimizer) = optimizer {
        save_tensors(&staging.join(OPTIMIZER_FILE), optimizer)?;
        super::kill::point("checkpoint:optimizer");
    }
    write_synced(&staging.join("config.toml"), config.to_toml().as_bytes())?;
    let state_text = serde_json::to_string(state).map_err(other)?;
    write_synced(&staging.join("trainer_state.json"), state_text.as_bytes())?;
    write_checksums(&staging)?;
    super::kill::point("checkpoint:state");
    let target = run.checkpoint(step);
    if target.exists() {
        run.remove_checkpoint(step, &target)?;
    }
    fs::rename(&staging, &target)?;
    fs::File::open(&run.path)?.sync_all()?;
    super::kill::point("checkpoint:renamed");
    run.prune(keep)?;
    Ok(target)
}

/// A checkpoint read back, with its configuration as a `C`.
pub struct Loaded<C> {
    pub state: TrainerState,
    pub config: C,
    /// The trained tensors by name (weights or adapters).
    pub weights: HashMap<String, Tensor>,
    /// The optimizer's state; `None` in a checkpoint saved with `save_only_model`.
    pub optimizer: Option<HashMap<String, Tensor>>,
    /// PPO's value model (its trained tensors by name), when the run has one.
    pub critic: Option<HashMap<String, Tensor>>,
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

/// Reads `dir` (a `checkpoint-N` folder) onto the CPU, every file checked against its checksums.
pub fn load<C: serde::de::DeserializeOwned>(dir: &Path) -> Result<Loaded<C>, String> {
    let name = dir.display();
    let (state, config) = read_state(dir)?;
    verify(dir, |name| {
        name != "trainer_state.json" && name != "config.toml"
    })?;
    let tensors = |file: &str| {
        candle_core::safetensors::load(dir.join(file), &candle_core::Device::Cpu)
            .map_err(|error| format!("{name}/{file}: {error}"))
    };
    let weights = if dir.join("adapter_model.safetensors").is_file() {
        tensors("adapter_model.safetensors")?
    } else {
        tensors("model.safetensors")?
    };
    let optimizer = if dir.join(OPTIMIZER_FILE).is_file() {
        Some(tensors(OPTIMIZER_FILE)?)
    } else {
        None
    };
    let critic = if dir.join(CRITIC_FILE).is_file() {
        Some(tensors(CRITIC_FILE)?)
    } else {
        None
    };
    Ok(Loaded {
        state,
        config,
        weights,
        optimizer,
        critic,
    })
}

/// Sets every var from `tensors` by name; each must be there, with the var's shape.
pub fn restore(vars: &[(String, Var)], tensors: &HashMap<String, Tensor>) -> Result<(), String> {
    for (name, var) in vars {
        let tensor = tensors
            .get(name)
            .ok_or_else(|| format!("the checkpoint has no tensor {name}"))?;
        if tensor.dims() != var.dims() {
            return Err(format!(
                "{name} has shape {:?} in the checkpoint, {:?} in the model",
                tensor.dims(),
                var.dims()
            ));
        }
        let tensor = tensor
            .to_device(var.device())
            .and_then(|t| t.to_dtype(var.dtype()))
            .map_err(|error| error.to_string())?;
        var.set(&tensor).map_err(|error| error.to_string())?;
    }
    Ok(())
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
