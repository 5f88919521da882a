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

/// Elements read and converted at a time when a tensor changes type (or leaves the CPU) on its way in:
/// what is held beside the tensor is one such slice in the file's type, not the whole tensor.
const SLICE_ELEMENTS: usize = 1 << 18;

/// Reads every tensor of a safetensors file into `tensors`, converted to `dtype`, one tensor at a time,
/// each straight into the memory it keeps ([`read_tensor`]): the peak is the model plus a slice of one
/// tensor. (Reading each tensor into a buffer and copying it into the tensor held the largest tensor
/// twice, the embedding matrix: Qwen3-0.6B's 594 MiB in f32 above its 2,273 MiB of weights.)
///
/// A tensor that `by_expert` names (gpt-oss's expert stacks, [`crate::model::read_by_expert`]) is read
/// as one tensor per index of its first dimension, `{name}.{e}`.
pub(crate) fn read_safetensors(
    file: &Path,
    dtype: DType,
    device: &Device,
    by_expert: &dyn Fn(&str) -> bool,
    tensors: &mut HashMap<String, Tensor>,
) -> Result<(), String> {
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
        let stored =
            DType::try_from(info.dtype).map_err(|error| format!("tensor {name}: {error}"))?;
        let bytes = info.shape.iter().product::<usize>() * stored.size_in_bytes();
        if end - start != bytes as u64 {
            return Err(format!(
                "tensor {name}: {} bytes of data for {bytes} bytes of {stored:?} of shape {:?}",
                end - start,
                info.shape
            ));
        }
        infos.push((name, stored, info));
    }
    infos.sort_by_key(|(_, _, info)| info.data_offsets.0);
    for (name, stored, info) in infos {
        // Bytes are MXFP4 blocks and scales (`crate::mxfp4`), dequantized once all are read.
        let dtype = match stored {
            DType::U8 => DType::U8,
            _ => dtype,
        };
        reader
            .seek(SeekFrom::Start(data_start + info.data_offsets.0))
            .map_err(|error| format!("tensor {name}: {error}"))?;
        let mut read = |shape: &[usize]| {
            read_tensor(&mut reader, stored, shape, dtype, device, SLICE_ELEMENTS)
                .map_err(|error| format!("tensor {name}: {error}"))
        };
        match info.shape.split_first() {
            Some((&experts, shape)) if by_expert(&name) => {
                for e in 0..experts {
                    tensors.insert(format!("{name}.{e}"), read(shape)?);
                }
            }
            _ => {
                let tensor = read(&info.shape)?;
                tensors.insert(name, tensor);
            }
        }
    }
    Ok(())
}

/// The tensor of `shape` whose values, of type `stored`, come next from `reader`, as `dtype` on
/// `device`. Kept in its type on the CPU, it is read into the vector the tensor then owns; otherwise
/// it is read, converted and copied `slice` elements at a time into a tensor made for it. Either way
/// no second copy of the whole tensor exists at any time.
fn read_tensor(
    reader: &mut impl std::io::Read,
    stored: DType,
    shape: &[usize],
    dtype: DType,
    device: &Device,
    slice: usize,
) -> candle_core::Result<Tensor> {
    let count = shape.iter().product::<usize>();
    if stored == dtype && device.is_cpu() {
        return read_values(reader, stored, count)?.reshape(shape);
    }
    let tensor = Tensor::zeros(count, dtype, device)?;
    for start in (0..count).step_by(slice.max(1)) {
        let part = read_values(reader, stored, slice.min(count - start))?
            .to_dtype(dtype)?
            .to_device(device)?;
        tensor.slice_set(&part, 0, start)?;
    }
    tensor.reshape(shape)
}

/// `count` values of type `stored` from `reader`, as a CPU tensor that owns the vector they were read
/// into (`Tensor::from_vec` takes it without a copy).
fn read_values(
    reader: &mut impl std::io::Read,
    stored: DType,
    count: usize,
) -> candle_core::Result<Tensor> {
    fn read<T: candle_core::WithDType>(
        reader: &mut impl std::io::Read,
        count: usize,
    ) -> candle_core::Result<Tensor> {
        let mut values = vec![T::from_f64(0.0); count];
        // SAFETY: candle's element types are plain numbers without padding, for which every bit
        // pattern is a value, and the slice is exactly the vector's initialised values. Safetensors
        // stores them little-endian, the byte order of every target candle reads them on (its own
        // loader copies the bytes as they are too).
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                values.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(values.as_slice()),
            )
        };
        reader.read_exact(bytes)?;
        Tensor::from_vec(values, count, &Device::Cpu)
    }
    match stored {
        DType::U8 => read::<u8>(reader, count),
        DType::U32 => read::<u32>(reader, count),
        DType::I16 => read::<i16>(reader, count),
        DType::I32 => read::<i32>(reader, count),
        DType::I64 => read::<i64>(reader, count),
        DType::BF16 => read::<half::bf16>(reader, count),
        DType::F16 => read::<half::f16>(reader, count),
        DType::F32 => read::<f32>(reader, count),
        DType::F64 => read::<f64>(reader, count),
        // Types without a Rust number type here (FP8): read as bytes and copied once, as candle does.
        other => {
            let mut bytes = vec![0u8; count * other.size_in_bytes()];
            reader.read_exact(&mut bytes)?;
            Tensor::from_raw_buffer(&bytes, other, &[count], &Device::Cpu)
        }
    }
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
        let by_expert = |name: &str| crate::model::read_by_expert(&config, name);
        read_safetensors(file, dtype, device, &by_expert, &mut tensors).map_err(|message| {
            LoadError::Weights {
                file: file.clone(),
                message,
            }
        })?;
    }
    let tensors = text_tower_tensors(tensors);
    // MXFP4 experts dequantized, then gpt-oss's stacks (and stacks read by expert) split into the
    // experts the model holds.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A tensor read a slice at a time (three values, which do not divide its ten) holds what the
    /// whole tensor converted at once holds, and the reader stops at its last byte.
    #[test]
    fn a_tensor_read_in_slices_is_the_tensor_converted_whole() {
        let values: Vec<f32> = (0..10).map(|i| (i as f32 - 4.5) * 0.3173).collect();
        let whole = Tensor::from_vec(values.clone(), (2, 5), &Device::Cpu).unwrap();
        for stored in [DType::F32, DType::BF16] {
            let file = whole.to_dtype(stored).unwrap();
            let mut bytes: Vec<u8> = match stored {
                DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                _ => (file.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap())
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            };
            bytes.extend_from_slice(b"next");
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let mut reader = bytes.as_slice();
                let read =
                    read_tensor(&mut reader, stored, &[2, 5], dtype, &Device::Cpu, 3).unwrap();
                assert_eq!((read.dims(), read.dtype()), ([2, 5].as_slice(), dtype));
                let exact = |tensor: &Tensor| {
                    tensor
                        .to_dtype(DType::F64)
                        .and_then(|tensor| tensor.to_vec2::<f64>())
                        .unwrap()
                };
                assert_eq!(
                    exact(&read),
                    exact(&file.to_dtype(dtype).unwrap()),
                    "{stored:?} read as {dtype:?}"
                );
                assert_eq!(reader, b"next");
            }
        }
    }
}
