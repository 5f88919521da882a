//! Reading a Hugging Face model folder: `config.json`, `model.safetensors` or a sharded
//! `model.safetensors.index.json`, `tokenizer.json`, `tokenizer_config.json` (chat template) and
//! `generation_config.json` (end-of-turn tokens); or a GGUF file, which holds all of these (see [`gguf`]).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use serde_json::Value;
use tokenizers::Tokenizer;

use super::config::ModelConfig;
pub use super::error::LoadError;
use super::gguf;
use super::model::Model;
use holo_core::chat::folder::{self, read_json};
use holo_core::chat::ChatTemplate;

/// The safetensors files of a folder, in shard order.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let invalid = |message: String| LoadError::Weights {
            file: index.clone(),
            message,
        };
        let json = read_json(&index).map_err(invalid)?;
        let map = json
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid("no `weight_map` object".into()))?;
        let mut files = BTreeSet::new();
        for (tensor, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| invalid(format!("`weight_map.{tensor}` is not a file name")))?;
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(invalid(format!(
                    "`weight_map.{tensor}` names {file:?}, outside the folder"
                )));
            }
            files.insert(file.to_string());
        }
        return files
            .into_iter()
            .map(|file| {
                let path = dir.join(&file);
                if path.is_file() {
                    Ok(path)
                } else {
                    Err(invalid(format!("shard {file} is missing")))
                }
            })
            .collect();
    }
    let mut found: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|entry| entry.ok())
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    Err(LoadError::NoWeights {
        dir: dir.to_path_buf(),
        found,
    })
}

/// Reads every tensor of a safetensors file into `tensors`, converted to `dtype`, one tensor at a time:
/// the peak memory is the model plus one tensor, not the model plus a mapping of the whole file.
fn read_safetensors(
    file: &Path,
    dtype: DType,
    device: &Device,
    tensors: &mut HashMap<String, Tensor>,
) -> Result<(), String> {
    use candle_core::safetensors::Load;
    use std::io::{Read, Seek, SeekFrom};

    #[derive(serde::Deserialize)]
    struct Info {
        dtype: safetensors::Dtype,
        shape: Vec<usize>,
        data_offsets: (u64, u64),
    }

    let mut reader = std::fs::File::open(file).map_err(|error| format!("cannot open: {error}"))?;
    let length = reader
        .metadata()
        .map_err(|error| format!("cannot read: {error}"))?
        .len();
    let mut header_len = [0u8; 8];
    reader
        .read_exact(&mut header_len)
        .map_err(|_| "not a safetensors file: shorter than its header".to_string())?;
    let header_len = u64::from_le_bytes(header_len);
    if header_len > 100 << 20 || 8 + header_len > length {
        return Err(format!(
            "not a safetensors file: header length {header_len} in a file of {length} bytes"
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    reader
        .read_exact(&mut header)
        .map_err(|error| format!("cannot read the header: {error}"))?;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&header)
        .map_err(|error| format!("invalid safetensors header: {error}"))?;
    let data_start = 8 + header_len;
    let mut infos = Vec::new();
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let info: Info = serde_json::from_value(info)
            .map_err(|error| format!("invalid header entry for {name}: {error}"))?;
        let (start, end) = info.data_offsets;
        if start > end || data_start + end > length {
            return Err(format!(
                "tensor {name}: data {start}..{end} lies outside the file ({length} bytes)"
            ));
        }
        infos.push((name, info));
    }
    infos.sort_by_key(|(_, info)| info.data_offsets.0);
    let mut buffer = Vec::new();
    for (name, info) in infos {
        let (start, end) = info.data_offsets;
        buffer.resize((end - start) as usize, 0);
        reader
            .seek(SeekFrom::Start(data_start + start))
            .and_then(|_| reader.read_exact(&mut buffer))
            .map_err(|error| format!("cannot read tensor {name}: {error}"))?;
        let tensor = safetensors::tensor::TensorView::new(info.dtype, info.shape, &buffer)
            .map_err(|error| format!("tensor {name}: {error}"))?
            .load(device)
            // Bytes are MXFP4 blocks and scales (`crate::mxfp4`), dequantized once all are read.
            .and_then(|tensor| match tensor.dtype() {
                DType::U8 => Ok(tensor),
                _ => tensor.to_dtype(dtype),
            })
            .map_err(|error| format!("tensor {name}: {error}"))?;
        tensors.insert(name, tensor);
    }
    Ok(())
}

/// Loads the model's weights in `dtype` (converted from whatever the files hold) from a model folder or
/// a `.gguf` file.
pub fn load_model(dir: &Path, dtype: DType, device: &Device) -> Result<Model, LoadError> {
    Ok(load_model_with(dir, dtype, device, &[])?.0)
}

/// [`load_model`], also returning those of the tensors named in `extra` that the folder's files hold
/// beside the model's (a sequence classifier's `score.weight`, say; a `.gguf` file has none).
pub fn load_model_with(
    dir: &Path,
    dtype: DType,
    device: &Device,
    extra: &[&str],
) -> Result<(Model, HashMap<String, Tensor>), LoadError> {
    if gguf::is_gguf(dir) {
        return Ok((gguf::load_model(dir, dtype, device)?, HashMap::new()));
    }
    if !dir.is_dir() {
        return Err(LoadError::NotAFolder(dir.to_path_buf()));
    }
    let config = ModelConfig::from_file(&dir.join("config.json")).map_err(LoadError::Config)?;
    let files = weight_files(dir)?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for file in &files {
        read_safetensors(file, dtype, device, &mut tensors).map_err(|message| {
            LoadError::Weights {
                file: file.clone(),
                message,
            }
        })?;
    }
    let tensors = text_tower_tensors(tensors);
    // MXFP4 experts dequantized, then gpt-oss's stacks split into the experts the model holds.
    let mut tensors = crate::mxfp4::dequantize_all(tensors, dtype)
        .and_then(|tensors| crate::model::held_tensors(&config, tensors))
        .map_err(|error| LoadError::Weights {
            file: files[0].clone(),
            message: error.to_string(),
        })?;
    let found = extra
        .iter()
        .filter_map(|name| Some((name.to_string(), tensors.remove(*name)?)))
        .collect();
    let vb = VarBuilder::from_tensors(tensors, dtype, device);
    let first = files[0].clone();
    let model = Model::load(vb, &config).map_err(|error| LoadError::Weights {
        file: if files.len() == 1 {
            first
        } else {
            dir.join("model.safetensors.index.json")
        },
        // candle names the tensor: "cannot find tensor model.norm.weight", "shape mismatch for …".
        message: format!(
            "{} checkpoint does not fit its config.json: {error}",
            config.arch
        ),
    })?;
    Ok((model, found))
}

/// A multimodal checkpoint's text tower under the text model's names: Gemma 3's
/// `Gemma3ForConditionalGeneration` saves it as `language_model.model.*` and `language_model.lm_head.*`
/// (transformers 4) or `model.language_model.*` (transformers 5, as its checkpoint conversion maps them);
/// Qwen3.5's `Qwen3_5ForConditionalGeneration` keeps `lm_head.*` beside the wrapper's `model`. The vision
/// tower, the projector and Qwen3.5's multi-token-prediction weights (`mtp.*`) are left out. A text model's tensors come back unchanged.
fn text_tower_tensors(tensors: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    const TOWERS: [(&str, &str); 4] = [
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        // Beside the wrapper's `model` (transformers 5, Qwen3.5).
        ("lm_head.", "lm_head."),
    ];
    let is_tower = |name: &str| TOWERS.iter().any(|(prefix, _)| name.starts_with(prefix));
    if tensors.contains_key("model.embed_tokens.weight")
        || !tensors.keys().any(|name| is_tower(name))
    {
        return tensors;
    }
    tensors
        .into_iter()
        .filter_map(|(name, tensor)| {
            let (prefix, text) = TOWERS.iter().find(|(prefix, _)| name.starts_with(prefix))?;
            Some((format!("{text}{}", &name[prefix.len()..]), tensor))
        })
        .collect()
}

/// The folder's `tokenizer.json` ([`folder::load_tokenizer`]), or the tokenizer of a `.gguf` file's
/// metadata.
pub fn load_tokenizer(dir: &Path) -> Result<Tokenizer, LoadError> {
    if gguf::is_gguf(dir) {
        return gguf::load_tokenizer(dir);
    }
    Ok(folder::load_tokenizer(dir)?)
}

/// The model's chat template ([`folder::load_template`]); ChatML when the folder (or `.gguf` file) has
/// none.
pub fn load_template(dir: &Path) -> Result<ChatTemplate, LoadError> {
    if gguf::is_gguf(dir) {
        return gguf::load_template(dir);
    }
    Ok(folder::load_template(dir)?)
}

/// Token ids that end a turn ([`folder::end_of_turn_ids_with`], with `config.json`'s ids as loaded). For a
/// `.gguf` file: `tokenizer.ggml.eos_token_id` (and `eot_token_id`, `eom_token_id`), and the template's
/// `eos_token`.
pub fn end_of_turn_ids(
    dir: &Path,
    config: &ModelConfig,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
) -> Result<Vec<u32>, LoadError> {
    Ok(folder::end_of_turn_ids_with(
        dir,
        &config.eos_token_ids,
        tokenizer,
        template,
    )?)
}
