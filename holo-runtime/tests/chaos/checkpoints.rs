//! Checkpoints under faults: the disk fills while `holo train` writes one (a small tmpfs as the run
//! folder's disk), and the newest checkpoint is corrupt or truncated when a run resumes.
//!
//! A full disk stops the run with an error that names the checkpoint and the want of space; the
//! checkpoints before it are intact, and once the disk has room `--resume` continues from them to the
//! metrics of a run that never met the fault. A damaged checkpoint is refused by `--resume`, naming the
//! file, with nothing else of the run touched; without it the run resumes from the one before.

use std::path::Path;
use std::time::Duration;

use crate::common::components;
use crate::common::run_metrics;
use crate::common::tempdir::Dir;
use crate::support::{checkpoints, each_seed, run, snapshot, train_args};

/// What one `holo train` of a few steps of the tiny model must end within.
const LIMIT: Duration = Duration::from_secs(120);

/// The tmpfs sizes (KiB) of the disk-full cases. A checkpoint of the tiny model is 1.3 MB (430 KB of
/// weights, 860 KB of AdamW moments), so the disk fills in checkpoint-2's `model.safetensors`, in its
/// `optimizer.safetensors`, then in checkpoint-3.
const DISKS: [u64; 3] = [1500, 2000, 2700];

/// The checkpoint a `cannot write the run: writing …/checkpoint-N: ` error names.
fn failed_checkpoint(output: &str) -> u64 {
    let at = output
        .find("cannot write the run: writing ")
        .unwrap_or_else(|| panic!("no failed write named:\n{output}"));
    let rest = &output[at..];
    let number = &rest[rest.find("checkpoint-").unwrap() + "checkpoint-".len()..];
    number[..number.find(':').unwrap()].parse().unwrap()
}

#[test]
fn a_disk_that_fills_while_a_checkpoint_is_written_stops_the_run_naming_it_and_resume_continues() {
    let probe = Dir::new("chaos-tmpfs-probe");
    if components::tmpfs(&probe.join("disk"), 64).is_none() {
        return;
    }
    // Seed i: the run seed, and the disk size of `DISKS[i]`.
    each_seed(&[0, 1, 2], |seed| {
        let kib = DISKS[seed as usize];
        let dir = Dir::new("chaos-disk-full");
        let whole = dir.join("whole");
        let (code, output) = run(&dir, "whole", &train_args(&whole, 4, seed, &[]), LIMIT);
        assert_eq!(code, 0, "{output}");

        let disk = components::tmpfs(&dir.join("disk"), kib).expect("mounted in the probe");
        let out = disk.dir.join("run");
        let args = train_args(&out, 4, seed, &[]);
        let (code, output) = run(&dir, "full", &args, LIMIT);
        assert_eq!(code, 1, "{output}");
        let full_at = failed_checkpoint(&output);
        assert!(
            full_at >= 2,
            "the disk holds the first checkpoint:\n{output}"
        );
        assert!(
            output.contains(&format!(
                "error: cannot write the run: writing {}: ",
                out.join(format!("checkpoint-{full_at}")).display()
            )) && output.contains("No space left on device"),
            "the error names the checkpoint and the full disk:\n{output}"
        );
        assert!(
            output.contains("`--resume` continues from the newest"),
            "{output}"
        );
        assert_eq!(
            checkpoints(&out),
            (1..full_at).collect::<Vec<_>>(),
            "the checkpoints before the full disk are there, complete, and no other"
        );
        let done = full_at as usize - 1;
        assert_eq!(
            run_metrics(&out)[..done],
            run_metrics(&whole)[..done],
            "the steps done before are logged as a run without the fault logs them"
        );

        // The disk has room again: the run continues from its newest checkpoint to the same end.
        disk.resize(16 * 1024);
        let mut resumed = args.clone();
        resumed.push("--resume".into());
        let (code, output) = run(&dir, "resumed", &resumed, LIMIT);
        assert_eq!(code, 0, "{output}");
        assert_eq!(run_metrics(&out), run_metrics(&whole));
        assert_eq!(checkpoints(&out), [1, 2, 3, 4]);
        let leftovers: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .filter(|name| name.ends_with(".tmp"))
            .collect();
        assert!(
            leftovers.is_empty(),
            "the failed save's folder is removed: {leftovers:?}"
        );
    });
}

/// Damages a file of a checkpoint folder as seed `seed` says; the file's name.
fn damage(checkpoint: &Path, seed: u64) -> &'static str {
    let (file, damage): (&str, fn(&Path)) = match seed {
        // Cut short mid-tensor, as a write killed halfway leaves a file.
        0 => ("model.safetensors", |path| truncate(path, 2)),
        // Emptied, as a crash after `create` and before the data reached the disk leaves it.
        1 => ("optimizer.safetensors", |path| truncate(path, usize::MAX)),
        2 => ("trainer_state.json", |path| truncate(path, 2)),
        // A header length past the file's end.
        _ => ("model.safetensors", |path| {
            let mut bytes = std::fs::read(path).unwrap();
            bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
            std::fs::write(path, bytes).unwrap();
        }),
    };
    damage(&checkpoint.join(file));
    file
}

/// Keeps the first `1 / divisor` of a file (nothing for `usize::MAX`).
fn truncate(path: &Path, divisor: usize) {
    let bytes = std::fs::read(path).unwrap();
    std::fs::write(path, &bytes[..bytes.len() / divisor]).unwrap();
}

#[test]
fn a_truncated_or_corrupt_checkpoint_is_refused_naming_the_file_and_the_one_before_resumes() {
    // Seed s: which file of the newest checkpoint is damaged, and how (`damage`).
    each_seed(&[0, 1, 2, 3], |seed| {
        let dir = Dir::new("chaos-corrupt");
        let out = dir.join("run");
        let args = train_args(&out, 4, seed, &[]);
        let (code, output) = run(&dir, "whole", &args, LIMIT);
        assert_eq!(code, 0, "{output}");
        let whole = run_metrics(&out);

        // The run was killed right after its third checkpoint, which is damaged.
        std::fs::remove_dir_all(out.join("checkpoint-4")).unwrap();
        let file = damage(&out.join("checkpoint-3"), seed);
        let before = snapshot(&out);
        let mut resumed = args.clone();
        resumed.push("--resume".into());
        let (code, output) = run(&dir, "refused", &resumed, LIMIT);
        assert_eq!(code, 2, "{output}");
        assert!(
            output.contains(&format!(
                "error: {}: ",
                out.join("checkpoint-3").join(file).display()
            )),
            "the refusal names the damaged file:\n{output}"
        );
        assert!(!output.contains("panicked"), "{output}");
        assert!(
            snapshot(&out) == before,
            "a refused resume changes nothing in the run folder"
        );

        // Without the damaged checkpoint the run resumes from the one before, to the same end.
        std::fs::remove_dir_all(out.join("checkpoint-3")).unwrap();
        let (code, output) = run(&dir, "resumed", &resumed, LIMIT);
        assert_eq!(code, 0, "{output}");
        assert_eq!(run_metrics(&out), whole);
        assert_eq!(checkpoints(&out), [1, 2, 3, 4]);
    });
}

/// A flipped bit in a weight file still parses: the checkpoint's checksums catch it, naming the file.
#[test]
fn a_checkpoint_with_a_flipped_bit_is_refused_naming_the_file() {
    let dir = Dir::new("chaos-bit-flip");
    let out = dir.join("run");
    let args = train_args(&out, 4, 0, &[]);
    let (code, output) = run(&dir, "whole", &args, LIMIT);
    assert_eq!(code, 0, "{output}");
    std::fs::remove_dir_all(out.join("checkpoint-4")).unwrap();
    let model = out.join("checkpoint-3/model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    // The lowest mantissa bit of the last weight: far past the header, a change no parser sees.
    let last = bytes.len() - 4;
    bytes[last] ^= 1;
    std::fs::write(&model, bytes).unwrap();
    let mut resumed = args;
    resumed.push("--resume".into());
    let (code, output) = run(&dir, "resumed", &resumed, LIMIT);
    assert_eq!(code, 2, "the damaged checkpoint was used:\n{output}");
    assert!(output.contains(&model.display().to_string()), "{output}");
}
