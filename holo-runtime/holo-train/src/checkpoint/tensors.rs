//! The checkpoint's tensors on candle (feature `local`): the trained weights or adapters, PPO's value
//! model and the optimizer's state written as safetensors files into a new `checkpoint-N/` ([`save`]),
//! read back ([`load`]) and set into the model's variables ([`restore`]). The folder's other files and
//! its atomic write are [`super`]'s, which every backend shares.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use candle_core::{Tensor, Var};

use super::{
    other, read_state, verify, write_checksums, write_synced, RunDir, TrainerState, CRITIC_FILE,
    OPTIMIZER_FILE,
};
use crate::config::TrainingConfig;
use crate::optim::StateTensor;

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
    crate::kill::point("checkpoint:staging");
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
    crate::kill::point("checkpoint:weights");
    if let Some(critic) = critic {
        save_tensors(
            &staging.join(CRITIC_FILE),
            critic
                .iter()
                .map(|(name, var)| (name.clone(), var.as_tensor().clone()))
                .collect(),
        )?;
        crate::kill::point("checkpoint:critic");
    }
    if let Some(optimizer) = optimizer {
        save_tensors(&staging.join(OPTIMIZER_FILE), optimizer)?;
        crate::kill::point("checkpoint:optimizer");
    }
    write_synced(&staging.join("config.toml"), config.to_toml().as_bytes())?;
    let state_text = serde_json::to_string(state).map_err(other)?;
    write_synced(&staging.join("trainer_state.json"), state_text.as_bytes())?;
    write_checksums(&staging)?;
    crate::kill::point("checkpoint:state");
    let target = run.checkpoint(step);
    if target.exists() {
        run.remove_checkpoint(step, &target)?;
    }
    fs::rename(&staging, &target)?;
    fs::File::open(&run.path)?.sync_all()?;
    crate::kill::point("checkpoint:renamed");
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
