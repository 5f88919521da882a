//! New weights for a loaded model, read from files: a PEFT LoRA adapter folder ([`with_adapter`]) or
//! full weights in safetensors ([`with_weights`]). Each returns a new [`Model`] and leaves the base as it
//! is, so whoever samples the base goes on sampling it; every mismatch is refused, naming the key or
//! tensor, before anything is built. `holo serve`'s weight updates and `holo export`'s merge read
//! adapters here.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;
use serde_json::Value;

use crate::model::{LoraConfig, Model, Pattern, Targets};

/// The shape of a PEFT adapter from its `adapter_config.json`: rank, alpha (rsLoRA's `alpha / √r` as
/// LoRA's `alpha · √r / r`), target modules, target parameters (expert stacks, routers) and the rank
/// and alpha patterns, in the file's order; target modules as a list of names or a regular expression.
/// PEFT settings a plain `W x + scale · B A x` cannot honour (DoRA, biases, `modules_to_save`,
/// `layers_to_transform`, rsLoRA beside patterns) are refused, naming the key.
pub fn adapter_config(path: &Path) -> Result<LoraConfig, String> {
    let name = path.display();
    let text = fs::read_to_string(path).map_err(|error| format!("`{name}`: {error}"))?;
    let config: Value =
        serde_json::from_str(&text).map_err(|error| format!("`{name}`: {error}"))?;
    let field = |key: &str| {
        config
            .get(key)
            .ok_or_else(|| format!("`{name}` has no `{key}`"))
    };
    // PEFT writes these keys with `null`, `false`, `{}` or `[]` when they are unused.
    let set = |key: &str| {
        config.get(key).is_some_and(|value| match value {
            Value::Null | Value::Bool(false) => false,
            Value::Object(object) => !object.is_empty(),
            Value::Array(array) => !array.is_empty(),
            _ => true,
        })
    };
    for key in ["use_dora", "modules_to_save", "layers_to_transform"] {
        if set(key) {
            return Err(format!("`{name}`: `{key}` is not supported"));
        }
    }
    if let Some(bias) = config.get("bias").and_then(Value::as_str) {
        if bias != "none" {
            return Err(format!(
                "`{name}`: `bias` \"{bias}\" is not supported (only \"none\")"
            ));
        }
    }
    if let Some(peft_type) = config.get("peft_type").and_then(Value::as_str) {
        if peft_type != "LORA" {
            return Err(format!("`{name}`: `peft_type` {peft_type} is not LoRA"));
        }
    }
    let rank = field("r")?
        .as_u64()
        .filter(|&rank| rank > 0)
        .ok_or_else(|| format!("`{name}`: `r` is not a whole number above 0"))?;
    let alpha = field("lora_alpha")?
        .as_f64()
        .ok_or_else(|| format!("`{name}`: `lora_alpha` is not a number"))?;
    let pattern = |key: &str| match config.get(key) {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(pattern) => pattern.clone(),
    };
    let rank_pattern: Pattern<usize> = serde_json::from_value(pattern("rank_pattern"))
        .map_err(|error| format!("`{name}`: `rank_pattern` is not a table of ranks: {error}"))?;
    let alpha_pattern: Pattern<f64> = serde_json::from_value(pattern("alpha_pattern"))
        .map_err(|error| format!("`{name}`: `alpha_pattern` is not a table of numbers: {error}"))?;
    // rsLoRA scales by alpha / √r where LoRA scales by alpha / r: the same as LoRA with alpha · √r.
    let alpha = if set("use_rslora") {
        // PEFT refuses the two together as well.
        if !rank_pattern.is_empty() || !alpha_pattern.is_empty() {
            return Err(format!(
                "`{name}`: `use_rslora` beside `rank_pattern` or `alpha_pattern` is not supported"
            ));
        }
        alpha * (rank as f64).sqrt()
    } else {
        alpha
    };
    // A list of names, or one string: a regular expression (or "all-linear"), as PEFT reads it.
    let targets: Targets =
        serde_json::from_value(field("target_modules")?.clone()).map_err(|_| {
            format!("`{name}`: `target_modules` is neither a list of names nor a string")
        })?;
    targets
        .check()
        .map_err(|error| format!("`{name}`: `target_modules`: {error}"))?;
    // PEFT's adapters on parameters (a mixture's expert stacks); absent before PEFT 0.17.
    let parameters = match config.get("target_parameters") {
        None | Some(Value::Null) => Vec::new(),
        Some(parameters) => parameters
            .as_array()
            .and_then(|parameters| {
                parameters
                    .iter()
                    .map(|target| target.as_str().map(str::to_string))
                    .collect::<Option<Vec<String>>>()
            })
            .ok_or_else(|| format!("`{name}`: `target_parameters` is not a list of names"))?,
    };
    Ok(LoraConfig {
        rank: rank as usize,
        alpha,
        targets,
        // The adapters are read from the files: their initialization does not matter.
        seed: 0,
        dropout: 0.0,
        parameters,
        rank_pattern,
        alpha_pattern,
    })
}

/// `base` with the PEFT adapter of the folder `dir` (`adapter_config.json`,
/// `adapter_model.safetensors`) on its projections, unmerged: each adapted projection computes
/// `W x + scale · B (A x)`, as the trainer's LoRA model does, so a server sampling it reports the
/// trainer's log-probabilities to rounding. A tensor the config does not describe (a module this model
/// lacks, a rank other than the config's `r` or pattern gives it) or one it lacks is refused by name.
pub fn with_adapter(base: &Model, dir: &Path) -> Result<Model, String> {
    let config_file = dir.join("adapter_config.json");
    let tensors_file = dir.join("adapter_model.safetensors");
    for file in [&config_file, &tensors_file] {
        if !file.is_file() {
            return Err(format!(
                "`{}` is not a PEFT adapter folder: it has no {}",
                dir.display(),
                file.file_name().unwrap_or_default().to_string_lossy()
            ));
        }
    }
    let lora = adapter_config(&config_file)?;
    let tensors = candle_core::safetensors::load(&tensors_file, &Device::Cpu)
        .map_err(|error| format!("`{}`: {error}", tensors_file.display()))?;
    let (adapted, vars) = base.with_lora(&lora).map_err(|error| {
        let message = error.to_string();
        if message.contains("which only samples") {
            "adapters run in the arithmetic of the weights' type, and this model keeps bf16 weights \
             for f32 arithmetic on the CPU; serve it with `--dtype f32`"
                .to_string()
        } else {
            format!("`{}`: {message}", config_file.display())
        }
    })?;
    // PEFT's `save_pretrained` saves an adapted head's base weight beside its adapter (it treats
    // `lm_head` as an embedding layer it may have resized): the base model's head serves in its place,
    // so it need only have the head's shape.
    let head_base = format!("{}.base_layer.weight", crate::model::HEAD_ADAPTER);
    let head_adapted = adapted.head_lora.is_some();
    if let (true, Some(saved)) = (head_adapted, tensors.get(&head_base)) {
        let (vocab, hidden) = (base.config.vocab_size, base.config.hidden_size);
        if saved.dims() != [vocab, hidden] {
            return Err(format!(
                "`{}` holds {head_base} of shape {:?}: the adapter's head is not this model's \
                 [{vocab}, {hidden}] (a resized vocabulary is not supported)",
                tensors_file.display(),
                saved.dims()
            ));
        }
    }
    if let Some(unused) = tensors
        .keys()
        .filter(|name| !(head_adapted && **name == head_base))
        .find(|name| !vars.iter().any(|(var, _)| var == *name))
    {
        return Err(format!(
            "`{}` holds {unused}, which belongs to no projection that `target_modules` {} (and \
             `target_parameters` {:?}) adapts on this {} model",
            tensors_file.display(),
            lora.targets,
            lora.parameters,
            base.config.arch
        ));
    }
    for (name, var) in &vars {
        let tensor = tensors.get(name).ok_or_else(|| {
            format!(
                "`{}` has no tensor {name}, which `target_modules` {} asks for",
                tensors_file.display(),
                lora.targets
            )
        })?;
        if tensor.dims() != var.dims() {
            let patterns = match lora.rank_pattern.is_empty() {
                true => String::new(),
                false => format!(" with `rank_pattern` {:?}", lora.rank_pattern.entries()),
            };
            return Err(format!(
                "{name} has shape {:?} in `{}`, but `r` = {}{patterns} on this model gives {:?}",
                tensor.dims(),
                tensors_file.display(),
                lora.rank,
                var.dims()
            ));
        }
        tensor
            .to_device(var.device())
            .and_then(|tensor| tensor.to_dtype(var.dtype()))
            .and_then(|tensor| var.set(&tensor))
            .map_err(|error| format!("{name}: {error}"))?;
    }
    Ok(adapted.detached())
}

/// A model of `base`'s architecture with the weights of `path`: a `.safetensors` file, or a model folder
/// (its `model*.safetensors` files, shards included; a checkpoint's optimizer state beside them is not
/// read). The tensors must be
/// exactly `base`'s, by name and shape (a missing, extra or reshaped one is refused by name before
/// anything is built); they are converted to `base`'s type and device.
pub fn with_weights(base: &Model, path: &Path) -> Result<Model, String> {
    let files = safetensors_files(path)?;
    let device = base.device().clone();
    let dtype = base.embed_tokens.dtype();
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    // Read in the served model's type on its device, each tensor straight into its memory: beside the
    // served model, the new one and a slice of a tensor (a mapping of the files, copied out of, held
    // the new weights once more).
    let by_expert = |name: &str| crate::model::read_by_expert(&base.config, name);
    for file in &files {
        crate::files::read_safetensors(file, dtype, &device, &by_expert, &mut tensors)
            .map_err(|error| format!("`{}`: {error}", file.display()))?;
    }
    let tensors = crate::mxfp4::dequantize_all(tensors, dtype)
        .and_then(|tensors| crate::model::held_tensors(&base.config, tensors))
        .map_err(|error| format!("`{}`: {error}", path.display()))?;
    let expected: HashMap<String, Vec<usize>> = base
        .named_weights()
        .into_iter()
        .map(|(name, tensor)| (name, tensor.dims().to_vec()))
        .collect();
    let mut missing: Vec<&String> = expected
        .keys()
        .filter(|name| !tensors.contains_key(*name))
        .collect();
    missing.sort();
    if let Some(name) = missing.first() {
        return Err(format!(
            "`{}` has no tensor {name} ({} of the model's {} tensors are missing)",
            path.display(),
            missing.len(),
            expected.len()
        ));
    }
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    for name in names {
        let tensor = &tensors[name];
        match expected.get(name) {
            None => {
                return Err(format!(
                    "`{}` holds {name}, which this {} model does not have",
                    path.display(),
                    base.config.arch
                ))
            }
            Some(shape) if shape.as_slice() != tensor.dims() => {
                return Err(format!(
                    "{name} has shape {:?} in `{}`, {shape:?} in the served model",
                    tensor.dims(),
                    path.display()
                ))
            }
            Some(_) => {}
        }
    }
    if base
        .layers
        .iter()
        .flat_map(Model::linears)
        .any(|(_, linear)| linear.weight.dense().is_err())
    {
        return Err(
            "this model samples a GGUF file's quantized blocks; new weights need dense ones".into(),
        );
    }
    Model::load(
        VarBuilder::from_tensors(tensors, dtype, &device),
        &base.config,
    )
    .map_err(|error| format!("`{}`: {error}", path.display()))
}

/// The weight files of `path`: itself, or a folder's `model*.safetensors` files, by name.
fn safetensors_files(path: &Path) -> Result<Vec<PathBuf>, String> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let entries = fs::read_dir(path).map_err(|error| format!("`{}`: {error}", path.display()))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|entry| Some(entry.ok()?.path()))
        .filter(|file| {
            let name = file.file_name().unwrap_or_default().to_string_lossy();
            name.starts_with("model") && name.ends_with(".safetensors")
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!(
            "`{}` holds no model*.safetensors file",
            path.display()
        ));
    }
    Ok(files)
}
