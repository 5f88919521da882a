//! A fresh folder under the system temp dir, outside any crate, removed when the test drops it.

use std::path::{Path, PathBuf};

/// `TMP/holoc-LABEL-PID-NAME`, created empty (with `subfolder` inside when given).
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(label: &str, name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("holoc-{label}-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
