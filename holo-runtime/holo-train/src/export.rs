//! `holo export`: a run's checkpoint as folders other tools load.
//!
//! The output folder is a Hugging Face model folder (`config.json`, `model.safetensors`, and the base
//! model's tokenizer, chat template and generation config) with the trained weights; for a LoRA run they
//! are the base weights with the adapters merged (`W + (alpha / r) · B A`), and the adapters themselves are
//! written in PEFT's layout under `adapter/` (`adapter_model.safetensors`, `adapter_config.json`), for
//! `PeftModel.from_pretrained(base, "DIR/adapter")`.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::checkpoint::{self, RunDir};
use holo_model::model::{LoraConfig, HEAD_ADAPTER};
use holo_model::{files as model_files, gguf, Model};

/// The run's facts that outlive the process: where its base model is.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RunInfo {
    /// The base model folder, as an absolute path.
    pub model: PathBuf,
}

impl RunInfo {
    pub const FILE: &'static str = "run.json";

    pub fn read(run_dir: &Path) -> Result<Self, String> {
        let path = run_dir.join(Self::FILE);
        let text = fs::read_to_string(&path)
            .map_err(|error| format!("`{}`: {error} (is it a run folder?)", path.display()))?;
        serde_json::from_str(&text).map_err(|error| format!("`{}`: {error}", path.display()))
    }

    pub fn write(&self, run_dir: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        fs::write(run_dir.join(Self::FILE), text)
    }
}

/// What [`export`] wrote.
#[derive(Debug, Clone)]
pub struct Exported {
    pub step: u64,
    pub model_dir: PathBuf,
    /// The PEFT adapter folder, for a LoRA run.
    pub adapter_dir: Option<PathBuf>,
}

/// Files of the base model folder that the exported folder keeps as they are.
const COPIED: [&str; 6] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
];

/// Exports checkpoint `step` (the newest when `None`) of the run in `run_dir` into `out`.
pub fn export(run_dir: &Path, step: Option<u64>, out: &Path) -> Result<Exported, String> {
    let run = RunDir::new(run_dir);
    let checkpoints = run
        .checkpoints()
        .map_err(|error| format!("`{}`: {error}", run_dir.display()))?;
    let (step, dir) = match step {
        Some(step) => checkpoints
            .into_iter()
            .find(|(found, _)| *found == step)
            .ok_or_else(|| format!("`{}` has no checkpoint-{step}", run_dir.display()))?,
        None => checkpoints
            .into_iter()
            .last()
            .ok_or_else(|| format!("`{}` has no checkpoint", run_dir.display()))?,
    };
    let info = RunInfo::read(run_dir)?;
    // Any trainer's checkpoint: its configuration is not needed (a LoRA run's adapters say their shape).
    let loaded = checkpoint::load::<toml::Table>(&dir)?;
    let base = base_folder(&info.model, out)?;
    let (weights, adapter_dir) = if dir.join("adapter_config.json").is_file() {
        let adapter_dir = out.join("adapter");
        fs::create_dir_all(&adapter_dir)
            .map_err(|error| format!("`{}`: {error}", adapter_dir.display()))?;
        for file in ["adapter_model.safetensors", "adapter_config.json"] {
            fs::copy(dir.join(file), adapter_dir.join(file))
                .map_err(|error| format!("copying {file}: {error}"))?;
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                fs::set_permissions(adapter_dir.join(file), fs::Permissions::from_mode(0o644))
                    .map_err(|error| format!("{file}: {error}"))?;
            }
        }
        let lora = holo_model::update::adapter_config(&dir.join("adapter_config.json"))?;
        let merged = merged(&base, &lora, &loaded.weights).map_err(|error| error.to_string())?;
        (merged, Some(adapter_dir))
    } else {
        let mut weights: HashMap<String, Tensor> = base.named_weights().into_iter().collect();
        for (name, tensor) in &loaded.weights {
            if !weights.contains_key(name) {
                return Err(format!(
                    "the checkpoint has {name}, which the base model lacks"
                ));
            }
            weights.insert(name.clone(), tensor.clone());
        }
        (weights, None)
    };
    save_weights(out, &base, weights)?;
    Ok(Exported {
        step,
        model_dir: out.to_path_buf(),
        adapter_dir,
    })
}

/// Loads the base model `model` and starts the folder `out` with its files: the configuration,
/// tokenizer, chat template and generation config a Hugging Face folder has, or those a GGUF file holds.
fn base_folder(model: &Path, out: &Path) -> Result<Model, String> {
    let base = model_files::load_model(model, DType::F32, &Device::Cpu)
        .map_err(|error| format!("the base model `{}`: {error}", model.display()))?;
    fs::create_dir_all(out).map_err(|error| format!("`{}`: {error}", out.display()))?;
    if gguf::is_gguf(model) {
        write_model_files(model, &base, out)?;
    } else {
        // A multimodal checkpoint's text tower is exported as the text model it trained: its own
        // config, since the tensors written are the text model's.
        let json: Option<serde_json::Value> = fs::read_to_string(model.join("config.json"))
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok());
        // gpt-oss's MXFP4 experts are written dequantized: its config, without the quantization.
        let own_config = json.as_ref().is_some_and(|json| {
            holo_model::config::is_text_tower(json) || json.get("quantization_config").is_some()
        });
        if own_config {
            let config = serde_json::to_string_pretty(&base.config.to_json())
                .map_err(|error| format!("writing config.json: {error}"))?;
            fs::write(out.join("config.json"), config)
                .map_err(|error| format!("writing config.json: {error}"))?;
        }
        for file in COPIED {
            let source = model.join(file);
            if own_config && file == "config.json" {
                continue;
            }
            if source.is_file() {
                fs::copy(&source, out.join(file))
                    .map_err(|error| format!("copying `{}`: {error}", source.display()))?;
            }
        }
    }
    Ok(base)
}

/// Whether `dir` is a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) rather
/// than a model folder.
pub fn is_adapter(dir: &Path) -> bool {
    dir.join("adapter_config.json").is_file() && !dir.join("config.json").is_file()
}

/// The base model of the PEFT adapter folder `adapter`: its `base_model_name_or_path` when that is a
/// local model (a path as written, or relative to the adapter folder), else an error that says so.
pub fn adapter_base(adapter: &Path) -> Result<PathBuf, String> {
    let path = adapter.join("adapter_config.json");
    let text =
        fs::read_to_string(&path).map_err(|error| format!("`{}`: {error}", path.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|error| format!("`{}`: {error}", path.display()))?;
    let base = config
        .get("base_model_name_or_path")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| format!("`{}` has no `base_model_name_or_path`", path.display()))?;
    [PathBuf::from(base), adapter.join(base)]
        .into_iter()
        .find(|candidate| candidate.exists())
        .ok_or_else(|| {
            format!(
                "`{}`: the base model `{base}` (`base_model_name_or_path`) is not a local folder or file",
                path.display()
            )
        })
}

/// Writes into `out` the model folder of the PEFT adapter folder `adapter` merged into the base model
/// `base`: `W + (alpha / r) · B A` for every adapted projection (`alpha / √r` with `use_rslora`). PEFT
/// settings this merge cannot honour (DoRA, biases, `modules_to_save`, LoRA on layers it cannot adapt)
/// are refused, naming the key.
pub fn merge_adapter(adapter: &Path, base: &Path, out: &Path) -> Result<(), String> {
    let tensors = adapter.join("adapter_model.safetensors");
    let adapters = candle_core::safetensors::load(&tensors, &Device::Cpu)
        .map_err(|error| format!("`{}`: {error}", tensors.display()))?;
    let lora = holo_model::update::adapter_config(&adapter.join("adapter_config.json"))?;
    let model = base_folder(base, out)?;
    let weights = merged(&model, &lora, &adapters).map_err(|error| {
        format!(
            "`{}` does not fit the base model `{}`: {error}",
            adapter.display(),
            base.display()
        )
    })?;
    save_weights(out, &model, weights)
}

/// Writes `out/model.safetensors`: `weights` (named as `model` holds them) under the names and layouts
/// of the family's checkpoints (gpt-oss's experts stacked, [`holo_model::model::checkpoint_tensors`]).
/// A merged head adapter on a model whose head is tied to its embeddings leaves a head of its own
/// (`lm_head.weight`): the written config then says `tie_word_embeddings: false`.
fn save_weights(out: &Path, model: &Model, weights: HashMap<String, Tensor>) -> Result<(), String> {
    if model.config.tie_word_embeddings && weights.contains_key("lm_head.weight") {
        untie(&out.join("config.json"))?;
    }
    let weights =
        holo_model::model::checkpoint_tensors(&model.config, weights.into_iter().collect())
            .map_err(|error| format!("laying out the weights: {error}"))?;
    checkpoint::save_tensors(&out.join("model.safetensors"), weights)
        .map_err(|error| format!("writing model.safetensors: {error}"))
}

/// Sets `tie_word_embeddings` to false in the config file `path` (and in its `text_config`, where a
/// multimodal checkpoint keeps the text model's).
fn untie(path: &Path) -> Result<(), String> {
    let fail = |error: &dyn std::fmt::Display| format!("untying `{}`: {error}", path.display());
    let text = fs::read_to_string(path).map_err(|error| fail(&error))?;
    let mut config: serde_json::Value =
        serde_json::from_str(&text).map_err(|error| fail(&error))?;
    config["tie_word_embeddings"] = false.into();
    if let Some(text_config) = config.get_mut("text_config").filter(|c| c.is_object()) {
        text_config["tie_word_embeddings"] = false.into();
    }
    let text = serde_json::to_string_pretty(&config).map_err(|error| fail(&error))?;
    fs::write(path, text).map_err(|error| fail(&error))
}

/// A GGUF base has no files to copy: its config, tokenizer and chat template are written from what the
/// file holds, as a Hugging Face folder has them.
fn write_model_files(gguf_file: &Path, base: &Model, out: &Path) -> Result<(), String> {
    let fail = |what: &str, error: &dyn std::fmt::Display| format!("writing {what}: {error}");
    let config = serde_json::to_string_pretty(&base.config.to_json())
        .map_err(|error| fail("config.json", &error))?;
    fs::write(out.join("config.json"), config).map_err(|error| fail("config.json", &error))?;
    let tokenizer = model_files::load_tokenizer(gguf_file).map_err(|error| error.to_string())?;
    tokenizer
        .save(out.join("tokenizer.json"), false)
        .map_err(|error| fail("tokenizer.json", &error))?;
    let template = model_files::load_template(gguf_file).map_err(|error| error.to_string())?;
    let mut tokenizer_config = serde_json::json!({"tokenizer_class": "PreTrainedTokenizerFast"});
    for name in ["bos_token", "eos_token", "unk_token", "pad_token"] {
        if let Some(token) = template.special_token(name) {
            tokenizer_config[name] = token.into();
        }
    }
    fs::write(
        out.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tokenizer_config).unwrap_or_default(),
    )
    .map_err(|error| fail("tokenizer_config.json", &error))?;
    if !template.is_builtin() {
        if let Some(source) = template.source("default") {
            fs::write(out.join("chat_template.jinja"), source)
                .map_err(|error| fail("chat_template.jinja", &error))?;
        }
    }
    Ok(())
}

/// The base weights with the checkpoint's adapters merged into their projections.
fn merged(
    base: &Model,
    lora: &LoraConfig,
    adapters: &HashMap<String, Tensor>,
) -> candle_core::Result<HashMap<String, Tensor>> {
    let (adapted, vars) = base.with_lora(lora)?;
    checkpoint::restore(&vars, adapters).map_err(candle_core::Error::msg)?;
    // A tensor no adapter took (a module this model does not adapt) would be dropped without a word.
    // PEFT saves an adapted head's base weight beside its adapter: the base's head is merged instead.
    let head_base = format!("{HEAD_ADAPTER}.base_layer.weight");
    if let Some(unused) = adapters
        .keys()
        .filter(|name| !(adapted.head_lora.is_some() && **name == head_base))
        .find(|name| !vars.iter().any(|(var, _)| var == *name))
    {
        candle_core::bail!("the adapters' tensor {unused} belongs to no adapted projection");
    }
    // The experts' adapters merge into their matrices; the projections' below.
    let adapted = adapted.with_experts_merged()?;
    let mut merged: HashMap<String, Tensor> = adapted.named_weights().into_iter().collect();
    for (i, layer) in adapted.layers.iter().enumerate() {
        for (name, linear) in Model::linears(layer) {
            if let Some(adapter) = &linear.lora {
                let delta = (adapter.b.matmul(&adapter.a)? * adapter.scale)?;
                merged.insert(
                    format!("model.layers.{i}.{name}.weight"),
                    (linear.weight.dense()? + delta)?,
                );
            }
        }
    }
    // The head's adapter merges into a head of its own: tied to the embeddings, the head would carry
    // the update into the input embeddings too, which the adapter never changed (`save_weights`
    // unties the exported config).
    if let Some(adapter) = &adapted.head_lora {
        let head = adapted.lm_head.as_ref().unwrap_or(&adapted.embed_tokens);
        let delta = (adapter.b.matmul(&adapter.a)? * adapter.scale)?;
        merged.insert("lm_head.weight".to_string(), (head + delta)?);
    }
    Ok(merged)
}
