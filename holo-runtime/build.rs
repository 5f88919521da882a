//! What `holo` was built from, for each run's `provenance.json`: the git commit of the sources, whether
//! they differed from it, and the workspace's `Cargo.lock` (copied into `OUT_DIR`, hashed at run time).
//!
//! The build script reruns when the commit moves (`.git/HEAD`, the refs, the index) or a source compiled
//! into the crates changes, so the flag follows the sources the build used.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The folders and files, relative to the workspace root, whose contents make `holo`.
const SOURCES: &[&str] = &[
    "Cargo.toml",
    "Cargo.lock",
    "holoc/src",
    "holoc/Cargo.toml",
    "holo-macros/src",
    "holo-macros/Cargo.toml",
    "holo-runtime/src",
    "holo-runtime/Cargo.toml",
    "holo-runtime/build.rs",
    "holo-runtime/holo-core",
    "holo-runtime/holo-model",
    "holo-runtime/holo-train",
    "holo-runtime/holo-serve",
    "holo-runtime/holo-engines",
    "holo-runtime/holo-sandbox",
];

fn main() {
    let crate_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let root = crate_dir.join("..");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it"));

    let lock = std::fs::read(root.join("Cargo.lock")).unwrap_or_default();
    std::fs::write(out.join("Cargo.lock"), lock).expect("OUT_DIR is writable");

    let git = |args: &[&str]| -> Option<String> {
        let output = Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(args)
            .output()
            .ok()?;
        output
            .status
            .success()
            .then(|| String::from_utf8_lossy(&output.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "HEAD"]).filter(|commit| !commit.is_empty());
    let dirty = match commit {
        Some(_) => {
            let mut args = vec!["status", "--porcelain", "--"];
            args.extend(SOURCES);
            git(&args).map(|changes| (!changes.is_empty()).to_string())
        }
        None => None,
    };
    println!(
        "cargo:rustc-env=HOLO_GIT_COMMIT={}",
        commit.as_deref().unwrap_or("unknown")
    );
    println!(
        "cargo:rustc-env=HOLO_GIT_DIRTY={}",
        dirty.as_deref().unwrap_or("unknown")
    );

    for source in SOURCES {
        println!("cargo:rerun-if-changed={}", root.join(source).display());
    }
    if let Some(git_dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        let git_dir = Path::new(&git_dir);
        for file in ["HEAD", "index", "packed-refs", "refs/heads"] {
            println!("cargo:rerun-if-changed={}", git_dir.join(file).display());
        }
    }
}
