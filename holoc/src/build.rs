//! The build-script step: compile a folder of `.hol` files into Rust modules under `OUT_DIR`, for crates
//! that prefer a build script to `include_holoware!`.
//!
//! ```no_run
//! // in build.rs's main:
//! holoc::build::compile("hol").unwrap();
//! ```
//!
//! ```ignore
//! // src/lib.rs: defines `pub mod tool`, with holotypes resolved in this module.
//! include!(concat!(env!("OUT_DIR"), "/holoware/tool.rs"));
//! ```

use std::fmt;
use std::path::{Path, PathBuf};

use crate::codegen::{self, Settings};
use crate::report::SourceFile;
use crate::{scan, Options};

/// Why a build-script compile failed: I/O problems, or diagnostics rendered as rustc renders them.
#[derive(Debug)]
pub struct BuildError {
    pub message: String,
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for BuildError {}

/// One compiled file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generated {
    pub source: PathBuf,
    pub output: PathBuf,
    pub module: String,
    /// The files besides the source that the checker read ([`crate::ir::Program::read`]).
    pub read: Vec<PathBuf>,
}

/// Compiles every `*.hol` under `dir` (relative to `CARGO_MANIFEST_DIR`) into
/// `$OUT_DIR/holoware/<module>.rs`, and tells cargo to rerun when any of them changes.
pub fn compile(dir: impl AsRef<Path>) -> Result<Vec<Generated>, BuildError> {
    let env = |name: &str| {
        std::env::var_os(name)
            .map(PathBuf::from)
            .ok_or_else(|| BuildError {
                message: format!("{name} is not set: holoc::build::compile runs in a build script"),
            })
    };
    let manifest_dir = env("CARGO_MANIFEST_DIR")?;
    let out_dir = env("OUT_DIR")?;
    let generated = compile_dir(&manifest_dir, dir.as_ref(), &out_dir.join("holoware"))?;
    println!(
        "cargo:rerun-if-changed={}",
        manifest_dir.join(dir.as_ref()).display()
    );
    for file in &generated {
        println!("cargo:rerun-if-changed={}", file.source.display());
        for read in &file.read {
            println!("cargo:rerun-if-changed={}", read.display());
        }
    }
    Ok(generated)
}

/// [`compile`] with explicit folders: `.hol` files under `crate_root/dir` are written to `out_dir`.
/// Every file is compiled; the error lists the diagnostics of all that failed.
pub fn compile_dir(
    crate_root: &Path,
    dir: &Path,
    out_dir: &Path,
) -> Result<Vec<Generated>, BuildError> {
    let io = |what: &str, path: &Path, error: std::io::Error| BuildError {
        message: format!("cannot {what} `{}`: {error}", path.display()),
    };
    let sources = crate::hol_files(&crate_root.join(dir))
        .map_err(|error| io("read", &crate_root.join(dir), error))?;
    std::fs::create_dir_all(out_dir).map_err(|error| io("create", out_dir, error))?;
    let options = Options::with_builtins(Some(scan::scan_crate(crate_root)));
    let mut generated = Vec::new();
    let mut failures = String::new();
    for source in sources {
        let bytes = std::fs::read(&source).map_err(|error| io("read", &source, error))?;
        let display_name = source
            .strip_prefix(crate_root)
            .unwrap_or(&source)
            .display()
            .to_string();
        let output = crate::compile(&bytes, &options.for_file(&source));
        let Some(program) = &output.program else {
            let file = SourceFile::new(&display_name, &output.source);
            for diagnostic in output
                .diagnostics
                .iter()
                .filter(|diagnostic| diagnostic.is_error())
            {
                failures.push_str(&file.plain(diagnostic));
            }
            continue;
        };
        let stem = source.file_stem().unwrap_or_default().to_string_lossy();
        let module = codegen::module_name(&stem);
        let file_name = module.to_string().trim_start_matches("r#").to_string();
        if let Some(other) = generated
            .iter()
            .find(|file: &&Generated| module == file.module)
        {
            failures.push_str(&format!(
                "error: `{}` and `{}` both compile to module `{module}`; rename one of them\n",
                other.source.display(),
                source.display()
            ));
            continue;
        }
        let path = out_dir.join(format!("{file_name}.rs"));
        let settings = Settings::new(module.clone(), display_name);
        let code = codegen::pretty(codegen::module(program, &settings));
        std::fs::write(&path, code).map_err(|error| io("write", &path, error))?;
        generated.push(Generated {
            source,
            output: path,
            module: module.to_string(),
            read: program.read.clone(),
        });
    }
    if failures.is_empty() {
        Ok(generated)
    } else {
        Err(BuildError { message: failures })
    }
}
