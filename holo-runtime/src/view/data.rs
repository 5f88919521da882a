//! What a page shows, read from disk: the rollouts of a rollouts JSONL or of a run folder, and a run
//! folder's metrics.

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::export::{parse_rollouts, Rollout};

/// The rollout files of a run folder that `holo view` shows, in this order.
pub const RUN_FILES: [&str; 2] = ["rollouts.jsonl", "eval_rollouts.jsonl"];

/// Why [`read`] found nothing to show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViewError {
    /// The path is not something to view: missing, a folder without rollouts, a file without a single
    /// rollout record.
    Input(String),
    /// A file could not be read or written.
    Io(String),
}

impl fmt::Display for ViewError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ViewError::Input(message) | ViewError::Io(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for ViewError {}

/// A line that is not what its file should hold, skipped.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Skipped {
    /// The file's name as the page shows it.
    pub file: String,
    /// 1-based.
    pub line: usize,
    pub message: String,
}

impl fmt::Display for Skipped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.file, self.line, self.message)
    }
}

/// One rollouts file.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutsFile {
    /// The name the page shows: the file name inside a run folder, else the path as given.
    pub name: String,
    pub rollouts: Vec<Rollout>,
}

/// Everything [`read`] found.
#[derive(Debug, Clone, PartialEq)]
pub struct Source {
    /// The path as given.
    pub path: PathBuf,
    /// One file, or the rollout files a run folder has ([`RUN_FILES`]).
    pub files: Vec<RolloutsFile>,
    /// A run folder's `metrics.jsonl`, one object per step.
    pub metrics: Option<Vec<Map<String, Value>>>,
    /// Every line skipped, in the order read.
    pub skipped: Vec<Skipped>,
}

impl Source {
    pub fn rollout_count(&self) -> usize {
        self.files.iter().map(|file| file.rollouts.len()).sum()
    }

    pub fn is_run_folder(&self) -> bool {
        self.path.is_dir()
    }
}

/// Reads `path`: a rollouts JSONL (`holo eval`'s `--out`, a run's `rollouts.jsonl`), or a run folder (its
/// [`RUN_FILES`] that exist, and `metrics.jsonl` when present). Lines that are not records are skipped and
/// listed in [`Source::skipped`]; a path with no rollout record at all is an error.
pub fn read(path: &Path) -> Result<Source, ViewError> {
    let mut source = Source {
        path: path.to_path_buf(),
        files: Vec::new(),
        metrics: None,
        skipped: Vec::new(),
    };
    if path.is_dir() {
        let present: Vec<&str> = RUN_FILES
            .into_iter()
            .filter(|name| path.join(name).is_file())
            .collect();
        if present.is_empty() {
            return Err(ViewError::Input(format!(
                "`{}` has no {} (is it a run folder?)",
                path.display(),
                RUN_FILES.join(" or ")
            )));
        }
        for name in present {
            read_rollouts_file(&mut source, &path.join(name), name)?;
        }
        let metrics = path.join("metrics.jsonl");
        if metrics.is_file() {
            source.metrics = Some(read_metrics(&mut source.skipped, &metrics)?);
        }
    } else if path.exists() {
        read_rollouts_file(&mut source, path, &path.display().to_string())?;
    } else {
        return Err(ViewError::Input(format!(
            "`{}`: no such file or folder",
            path.display()
        )));
    }
    if source.rollout_count() == 0 {
        return Err(ViewError::Input(nothing_to_show(&source)));
    }
    Ok(source)
}

/// The error for a source without a rollout record: what each file held instead.
fn nothing_to_show(source: &Source) -> String {
    let files: Vec<String> = source
        .files
        .iter()
        .map(|file| {
            let skipped: Vec<&Skipped> = source
                .skipped
                .iter()
                .filter(|skipped| skipped.file == file.name)
                .collect();
            match skipped.first() {
                None => format!("`{}` is empty", file.name),
                Some(first) => format!(
                    "none of the {} lines of `{}` is a rollout record (line {}: {})",
                    skipped.len(),
                    file.name,
                    first.line,
                    first.message
                ),
            }
        })
        .collect();
    format!("no rollout to show: {}", files.join("; "))
}

fn read_text(path: &Path) -> Result<String, ViewError> {
    std::fs::read_to_string(path)
        .map_err(|error| ViewError::Io(format!("cannot read `{}`: {error}", path.display())))
}

/// Reads one rollouts file with the export's reader ([`parse_rollouts`]), its bad lines into `skipped`.
fn read_rollouts_file(source: &mut Source, path: &Path, name: &str) -> Result<(), ViewError> {
    let (rollouts, bad_lines) = parse_rollouts(&read_text(path)?);
    source
        .skipped
        .extend(bad_lines.into_iter().map(|bad| Skipped {
            file: name.to_string(),
            line: bad.line,
            message: format!(
                "column {}: not a rollout record: {}",
                bad.column, bad.message
            ),
        }));
    source.files.push(RolloutsFile {
        name: name.to_string(),
        rollouts,
    });
    Ok(())
}

/// The JSON objects of `metrics.jsonl`; other non-blank lines go to `skipped`.
fn read_metrics(
    skipped: &mut Vec<Skipped>,
    path: &Path,
) -> Result<Vec<Map<String, Value>>, ViewError> {
    let mut metrics = Vec::new();
    for (index, line) in read_text(path)?.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Map<String, Value>>(line) {
            Ok(object) => metrics.push(object),
            Err(error) => skipped.push(Skipped {
                file: "metrics.jsonl".into(),
                line: index + 1,
                message: format!("not a JSON object: {error}"),
            }),
        }
    }
    Ok(metrics)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::fixtures::record;

    struct Dir(PathBuf);

    impl Dir {
        fn new(label: &str) -> Self {
            let path =
                std::env::temp_dir().join(format!("holo-view-{label}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).unwrap();
            Dir(path)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn line(row: usize) -> String {
        serde_json::to_string(&record(row, 0, 1.0, "42")).unwrap()
    }

    #[test]
    fn a_run_folder_gives_both_rollout_files_and_its_metrics() {
        let dir = Dir::new("run");
        std::fs::write(dir.0.join("rollouts.jsonl"), line(0) + "\n" + &line(1)).unwrap();
        std::fs::write(dir.0.join("eval_rollouts.jsonl"), line(5)).unwrap();
        std::fs::write(
            dir.0.join("metrics.jsonl"),
            "{\"step\": 1, \"loss\": 0.5}\n[1]\n",
        )
        .unwrap();
        let source = read(&dir.0).unwrap();
        let names: Vec<&str> = source.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, RUN_FILES);
        assert_eq!(source.rollout_count(), 3);
        assert_eq!(source.metrics.as_ref().unwrap().len(), 1);
        assert_eq!(source.skipped.len(), 1);
        assert_eq!(
            (source.skipped[0].file.as_str(), source.skipped[0].line),
            ("metrics.jsonl", 2)
        );
    }

    #[test]
    fn bad_lines_are_skipped_and_named() {
        let dir = Dir::new("bad");
        let path = dir.0.join("r.jsonl");
        std::fs::write(&path, format!("{}\noops\n{}\n", line(0), line(1))).unwrap();
        let source = read(&path).unwrap();
        assert_eq!(source.rollout_count(), 2);
        assert_eq!(source.skipped.len(), 1);
        assert_eq!(source.skipped[0].line, 2);
        assert!(
            source.skipped[0].message.contains("not a rollout record"),
            "{}",
            source.skipped[0]
        );
    }

    #[test]
    fn nothing_to_show_is_an_input_error_saying_why() {
        let dir = Dir::new("empty");
        let empty = dir.0.join("empty.jsonl");
        std::fs::write(&empty, "\n").unwrap();
        let error = read(&empty).unwrap_err();
        assert!(
            matches!(&error, ViewError::Input(m) if m.contains("is empty")),
            "{error}"
        );
        let junk = dir.0.join("junk.jsonl");
        std::fs::write(&junk, "a\nb\n").unwrap();
        let error = read(&junk).unwrap_err();
        assert!(
            matches!(&error, ViewError::Input(m) if m.contains("none of the 2 lines")),
            "{error}"
        );
        let error = read(&dir.0.join("missing.jsonl")).unwrap_err();
        assert!(
            matches!(&error, ViewError::Input(m) if m.contains("no such file")),
            "{error}"
        );
        let error = read(&dir.0).unwrap_err();
        assert!(
            matches!(&error, ViewError::Input(m) if m.contains("run folder")),
            "{error}"
        );
    }
}
