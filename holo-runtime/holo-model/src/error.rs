//! Why a model folder or a GGUF file could not be loaded ([`LoadError`]): what [`files`](crate::files)
//! and [`gguf`](crate::gguf) both return, below both of them.

use std::fmt;
use std::path::PathBuf;

use super::config::ConfigError;
use holo_core::chat::folder::FolderError;

/// Why a model folder or GGUF file could not be loaded; every variant names the file.
#[derive(Debug)]
pub enum LoadError {
    NotAFolder(PathBuf),
    Config(ConfigError),
    /// No weights in a format this runtime reads.
    NoWeights {
        dir: PathBuf,
        found: Vec<String>,
    },
    Weights {
        file: PathBuf,
        message: String,
    },
    /// The tokenizer, the chat template or the end-of-turn tokens, of a folder or a GGUF file's metadata.
    Folder(FolderError),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NotAFolder(dir) => write!(f, "{}: not a model folder", dir.display()),
            LoadError::Config(error) => write!(f, "{error}"),
            LoadError::NoWeights { dir, found } => {
                write!(
                    f,
                    "{}: no model.safetensors or model.safetensors.index.json",
                    dir.display()
                )?;
                if !found.is_empty() {
                    write!(f, " (found: {}", found.join(", "))?;
                    if found.iter().any(|name| name.ends_with(".bin")) {
                        write!(f, "; PyTorch .bin checkpoints are not read: convert them with `save_pretrained(..., safe_serialization=True)`")?;
                    }
                    write!(f, ")")?;
                }
                Ok(())
            }
            LoadError::Weights { file, message } => write!(f, "{}: {message}", file.display()),
            LoadError::Folder(error) => write!(f, "{error}"),
        }
    }
}

impl std::error::Error for LoadError {}

impl From<FolderError> for LoadError {
    fn from(error: FolderError) -> Self {
        LoadError::Folder(error)
    }
}
