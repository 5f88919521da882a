//! Rollouts people can read (`holo view`): one self-contained HTML page (style, script and data inlined;
//! nothing fetched from the network) for a rollouts JSONL or a run folder.
//!
//! - [`data::read`] reads the rollouts (with the export's reader, [`crate::export::parse_rollouts`]),
//!   and a run folder's `eval_rollouts.jsonl` and `metrics.jsonl`; lines that are not records are skipped
//!   and listed.
//! - [`page::render`] writes the page: a list of rollouts (filters by file, step, row, reward range,
//!   status and text; sort by reward) drawn a screenful at a time, so a file of 100k rollouts opens as fast
//!   as one of ten; the selected rollout's contexts as the model saw them, its reward components, the
//!   row's inputs, and its group (the rollouts of its row at its step) side by side; a run folder's
//!   metric curves and its completions step by step.
//! - [`http`] serves the page on the loopback interface (`holo view --serve`).
//!
//! Token texts come from the tokenizer the rollouts were recorded with ([`tokenizer`]), when there is
//! one; without it the page shows token ids. With a policy model (`holo view --policy DIR`), each trained
//! token also shows its log-probability under that model ([`policy`]) beside the sampler's.
//!
//! The page keeps its state (tab, filters, selection) in the URL's fragment, `page.html#status=failed&row=3`,
//! so a view can be bookmarked or shared, and opened already filtered.

pub mod data;
pub mod http;
pub mod page;
#[cfg(feature = "local")]
pub mod policy;

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

pub use data::{read, Source, ViewError};
pub use page::{render, Tokens};

/// The tokenizer of a model folder (`tokenizer.json`), or of a `.gguf` file with the `local` feature.
pub fn tokenizer(model: &Path) -> Result<Tokenizer, String> {
    #[cfg(feature = "local")]
    let loaded = crate::local::files::load_tokenizer(model).map_err(|error| error.to_string());
    #[cfg(not(feature = "local"))]
    let loaded = crate::chat::folder::load_tokenizer(model).map_err(|error| error.to_string());
    loaded.map_err(|error| {
        format!(
            "cannot load the tokenizer of `{}`: {error}",
            model.display()
        )
    })
}

/// The model a run folder was trained from (its `run.json`), where the rollouts' tokenizer is.
#[cfg(feature = "local")]
pub fn run_model(run_dir: &Path) -> Option<PathBuf> {
    crate::train::export::RunInfo::read(run_dir)
        .ok()
        .map(|info| info.model)
}

/// Without the `local` feature there are no run folders of this build's making.
#[cfg(not(feature = "local"))]
pub fn run_model(_run_dir: &Path) -> Option<PathBuf> {
    None
}
