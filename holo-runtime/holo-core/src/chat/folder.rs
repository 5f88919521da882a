//! What a Hugging Face model folder says about talking to its model, read without its weights:
//! `tokenizer.json`, the chat template, and the tokens that end a turn (`generation_config.json`,
//! `config.json`). The local model reads its folder through these, and so does everything that only
//! talks to a model running elsewhere (the Tinker backend, `holo view`).

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tokenizers::Tokenizer;

use super::{ChatTemplate, ChatTemplateError};

/// Why a model folder's tokenizer, template or end-of-turn tokens could not be read; every variant
/// names the file.
#[derive(Debug)]
pub enum FolderError {
    Tokenizer { file: PathBuf, message: String },
    Template(ChatTemplateError),
    GenerationConfig { file: PathBuf, message: String },
}

impl fmt::Display for FolderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FolderError::Tokenizer { file, message }
            | FolderError::GenerationConfig { file, message } => {
                write!(f, "{}: {message}", file.display())
            }
            FolderError::Template(error) => write!(f, "{error}"),
        }
    }
}

impl std::error::Error for FolderError {}

/// The folder's `tokenizer.json`.
pub fn load_tokenizer(dir: &Path) -> Result<Tokenizer, FolderError> {
    let file = dir.join("tokenizer.json");
    if !file.is_file() {
        return Err(FolderError::Tokenizer {
            file,
            message: "missing (a fast tokenizer file is required)".into(),
        });
    }
    Tokenizer::from_file(&file).map_err(|error| FolderError::Tokenizer {
        file,
        message: error.to_string(),
    })
}

/// The model's chat template; ChatML when the folder has none.
pub fn load_template(dir: &Path) -> Result<ChatTemplate, FolderError> {
    ChatTemplate::from_dir_or(dir, ChatTemplate::chatml()).map_err(FolderError::Template)
}

/// The end-of-turn tokens ([`end_of_turn_ids_with`]) of a folder whose weights are not loaded (the
/// tokenizer folder of a model that runs elsewhere): `config.json`'s `eos_token_id` is read from the
/// file, when there is one.
pub fn end_of_turn_ids(
    dir: &Path,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
) -> Result<Vec<u32>, FolderError> {
    let file = dir.join("config.json");
    let config_ids = if file.is_file() {
        read_json(&file)
            .and_then(|json| eos_token_ids(&json))
            .map_err(|message| FolderError::GenerationConfig {
                file: file.clone(),
                message,
            })?
    } else {
        Vec::new()
    };
    end_of_turn_ids_with(dir, &config_ids, tokenizer, template)
}

/// Token ids that end a turn: `generation_config.json`'s `eos_token_id` (one or a list), else
/// `config_ids` (`config.json`'s, as the caller loaded it), else the tokenizer's `eos_token` from
/// `tokenizer_config.json`.
pub fn end_of_turn_ids_with(
    dir: &Path,
    config_ids: &[u32],
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
) -> Result<Vec<u32>, FolderError> {
    let file = dir.join("generation_config.json");
    let mut ids = Vec::new();
    if file.is_file() {
        ids = read_json(&file)
            .and_then(|json| eos_token_ids(&json))
            .map_err(|message| FolderError::GenerationConfig {
                file: file.clone(),
                message,
            })?;
    }
    if ids.is_empty() {
        ids = config_ids.to_vec();
    }
    if let Some(id) = template
        .special_token("eos_token")
        .and_then(|token| tokenizer.token_to_id(token))
    {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    Ok(ids)
}

/// A JSON file of a model folder; the error says why, at which line and column, without the path.
pub fn read_json(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|error| format!("cannot read: {error}"))?;
    serde_json::from_str(&text).map_err(|error| {
        format!(
            "invalid JSON at line {} column {}: {error}",
            error.line(),
            error.column()
        )
    })
}

/// `eos_token_id` of `config.json` or `generation_config.json`: absent, one id, or a list of ids.
pub fn eos_token_ids(json: &Value) -> Result<Vec<u32>, String> {
    let id = |value: &Value| {
        value
            .as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| format!("`eos_token_id` must hold token ids, found {value}"))
    };
    match json.get("eos_token_id") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(ids)) => ids.iter().map(id).collect(),
        Some(value) => Ok(vec![id(value)?]),
    }
}
