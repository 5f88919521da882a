//! Training metrics: `metrics.jsonl`, TensorBoard event files (checked here and by TensorBoard's own
//! reader when the peer venv is installed) and the PNG charts of `plot_run`.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use holo_runtime::train::metrics::{read_metrics, MetricsLog};
use holo_runtime::train::report::plot::plot_run;

fn metrics(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn steps(path: &Path) -> Vec<u64> {
    read_metrics(path)
        .unwrap()
        .into_iter()
        .map(|(step, _)| step)
        .collect()
}

fn event_files(run_dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(run_dir.join("tensorboard"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    files
}

#[test]
fn jsonl_round_trips() {
    let dir = crate::common::tempdir::Dir::new("round-trip");
    let mut log = MetricsLog::create(dir.path()).unwrap();
    let rows = [
        (0, metrics(&[("eval/reward", 0.25), ("eval/pass@1", 0.0)])),
        (
            1,
            metrics(&[("loss", -0.125), ("reward", 0.1), ("kl", f64::NAN)]),
        ),
        (
            2,
            metrics(&[("loss", 1e-9), ("reward", 1.0 / 3.0), ("x", f64::INFINITY)]),
        ),
    ];
    for (step, row) in &rows {
        log.log(*step, row).unwrap();
    }
    let path = dir.path().join("metrics.jsonl");
    let text = fs::read_to_string(&path).unwrap();
    assert_eq!(
        text.lines().nth(1).unwrap(),
        r#"{"step":1,"kl":null,"loss":-0.125,"reward":0.1}"#
    );
    let read = read_metrics(&path).unwrap();
    assert_eq!(read.len(), rows.len());
    for ((step, row), (read_step, read_row)) in rows.iter().zip(&read) {
        assert_eq!(step, read_step);
        assert_eq!(
            row.keys().collect::<Vec<_>>(),
            read_row.keys().collect::<Vec<_>>()
        );
        for (name, value) in row {
            let back = read_row[name];
            if value.is_finite() {
                assert_eq!(value.to_bits(), back.to_bits(), "{name}");
            } else {
                assert!(
                    back.is_nan(),
                    "{name}: a value that is not finite reads back as NaN"
                );
            }
        }
    }

    let error = log.log(3, &metrics(&[("step", 1.0)])).unwrap_err();
    assert!(error.to_string().contains("`step`"), "{error}");
}

#[test]
fn read_errors_name_the_line_and_column() {
    let dir = crate::common::tempdir::Dir::new("read-errors");
    let path = dir.path().join("metrics.jsonl");
    let cases = [
        (
            "{\"step\":1}\n{\"step\":2,\"loss\":\"x\"}\n",
            ":2:20: invalid type: string \"x\", expected f64",
        ),
        (
            "{\"step\":1}\n\n{\"loss\":1}\n",
            ":3:10: the line has no `step`",
        ),
        (
            "{\"step\":-1}\n",
            ":1:10: invalid value: integer `-1`, expected u64",
        ),
        ("{\"step\":1,\"a\":1,\"a\":2}\n", "`a` appears twice"),
        ("{\"step\":1} x\n", ":1:12: trailing characters"),
        ("[1]\n", ":1:1: invalid type: sequence"),
    ];
    for (text, expected) in cases {
        fs::write(&path, text).unwrap();
        let error = read_metrics(&path).unwrap_err();
        assert!(
            error.starts_with(&path.display().to_string()) && error.contains(expected),
            "{text:?}: {error}"
        );
    }

    // A last line without its newline that does not parse is one still being written.
    fs::write(&path, "{\"step\":1}\n{\"step\":2,\"lo").unwrap();
    assert_eq!(steps(&path), [1]);
    // One that parses is whole.
    fs::write(&path, "{\"step\":1}\n{\"step\":2}").unwrap();
    assert_eq!(steps(&path), [1, 2]);

    let missing = dir.path().join("missing.jsonl");
    let error = read_metrics(&missing).unwrap_err();
    assert!(error.starts_with(&missing.display().to_string()), "{error}");
}

#[test]
fn resume_drops_later_steps_and_a_cut_short_line() {
    let dir = crate::common::tempdir::Dir::new("resume");
    let path = dir.path().join("metrics.jsonl");
    let mut log = MetricsLog::create(dir.path()).unwrap();
    for step in 0..=5 {
        log.log(step, &metrics(&[("reward", step as f64)])).unwrap();
    }
    drop(log);
    // A crash in the middle of a line.
    let mut text = fs::read_to_string(&path).unwrap();
    text.push_str("{\"step\":6,\"rew");
    fs::write(&path, &text).unwrap();

    let mut log = MetricsLog::resume(dir.path(), 3).unwrap();
    assert_eq!(steps(&path), [0, 1, 2, 3]);
    assert!(fs::read_to_string(&path).unwrap().ends_with("}\n"));
    log.log(4, &metrics(&[("reward", 40.0)])).unwrap();
    let read = read_metrics(&path).unwrap();
    assert_eq!(
        read.iter().map(|r| r.0).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4]
    );
    assert_eq!(read[4].1["reward"], 40.0);
    let leftovers: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.contains("tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // A line in the middle that does not parse stops the resume, naming it.
    fs::write(&path, "{\"step\":1}\nnot json\n{\"step\":2}\n").unwrap();
    let error = MetricsLog::resume(dir.path(), 3).err().unwrap();
    assert!(error.to_string().contains("metrics.jsonl:2:"), "{error}");

    // A run folder without metrics resumes with none.
    let fresh = crate::common::tempdir::Dir::new("resume-fresh");
    MetricsLog::resume(fresh.path(), 7).unwrap();
    assert!(steps(&fresh.path().join("metrics.jsonl")).is_empty());
}

/// A protocol buffer field as the wire has it.
#[derive(Debug, PartialEq)]
enum Field {
    Varint(u64),
    Fixed64(u64),
    Bytes(Vec<u8>),
    Fixed32(u32),
}

fn decode(mut bytes: &[u8]) -> Vec<(u32, Field)> {
    fn varint(bytes: &mut &[u8]) -> u64 {
        let mut value = 0;
        let mut shift = 0;
        loop {
            let byte = bytes[0];
            *bytes = &bytes[1..];
            value |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return value;
            }
            shift += 7;
        }
    }
    let mut fields = Vec::new();
    while !bytes.is_empty() {
        let key = varint(&mut bytes);
        let field = match key & 7 {
            0 => Field::Varint(varint(&mut bytes)),
            1 => {
                let (head, rest) = bytes.split_at(8);
                bytes = rest;
                Field::Fixed64(u64::from_le_bytes(head.try_into().unwrap()))
            }
            2 => {
                let length = varint(&mut bytes) as usize;
                let (head, rest) = bytes.split_at(length);
                bytes = rest;
                Field::Bytes(head.to_vec())
            }
            5 => {
                let (head, rest) = bytes.split_at(4);
                bytes = rest;
                Field::Fixed32(u32::from_le_bytes(head.try_into().unwrap()))
            }
            other => panic!("wire type {other}"),
        };
        fields.push(((key >> 3) as u32, field));
    }
    fields
}

fn masked(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// The records of a TFRecord file, each checked against its length and data CRCs.
fn read_records(path: &Path) -> Vec<Vec<u8>> {
    let bytes = fs::read(path).unwrap();
    let mut rest = &bytes[..];
    let mut records = Vec::new();
    while !rest.is_empty() {
        let length = &rest[..8];
        let length_crc = u32::from_le_bytes(rest[8..12].try_into().unwrap());
        assert_eq!(
            length_crc,
            masked(length),
            "length CRC of record {}",
            records.len()
        );
        let n = u64::from_le_bytes(length.try_into().unwrap()) as usize;
        let data = &rest[12..12 + n];
        let data_crc = u32::from_le_bytes(rest[12 + n..16 + n].try_into().unwrap());
        assert_eq!(
            data_crc,
            masked(data),
            "data CRC of record {}",
            records.len()
        );
        records.push(data.to_vec());
        rest = &rest[16 + n..];
    }
    records
}

#[test]
fn event_files_are_framed_tfrecords_of_events() {
    // The CRC-32C check value, so `masked` above is itself right.
    assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);

    let dir = crate::common::tempdir::Dir::new("events");
    let mut log = MetricsLog::create(dir.path()).unwrap();
    for step in 1..=3 {
        let row = metrics(&[("loss", step as f64 / 2.0), ("eval/pass@1", 0.75)]);
        log.log(step, &row).unwrap();
    }
    let files = event_files(dir.path());
    assert_eq!(files, [log.events_path().to_path_buf()]);
    let name = files[0].file_name().unwrap().to_str().unwrap().to_string();
    let parts: Vec<&str> = name.split('.').collect();
    assert_eq!(&parts[..3], ["events", "out", "tfevents"], "{name}");
    assert!(parts[3].parse::<u64>().unwrap() > 1_600_000_000, "{name}");
    assert_eq!(
        parts[parts.len() - 2],
        std::process::id().to_string(),
        "{name}"
    );

    let records = read_records(&files[0]);
    assert_eq!(records.len(), 1 + 3 * 2);
    let first = decode(&records[0]);
    assert!(matches!(first[0], (1, Field::Fixed64(_))), "{first:?}");
    assert_eq!(first[1], (3, Field::Bytes(b"brain.Event:2".to_vec())));

    // Step 2's `eval/pass@1` (tags in name order): wall_time, step, summary{value{tag, simple_value}}.
    let event = decode(&records[3]);
    assert_eq!(event.len(), 3, "{event:?}");
    assert_eq!(event[1], (2, Field::Varint(2)));
    let Field::Bytes(summary) = &event[2].1 else {
        panic!("{event:?}")
    };
    assert_eq!(event[2].0, 5);
    let summary = decode(summary);
    let Field::Bytes(value) = &summary[0].1 else {
        panic!("{summary:?}")
    };
    assert_eq!(
        decode(value),
        [
            (1, Field::Bytes(b"eval/pass@1".to_vec())),
            (2, Field::Fixed32(0.75f32.to_bits())),
        ]
    );

    // A resume opens a second file, named to be read after the first, that restarts at step 2.
    drop(log);
    let log = MetricsLog::resume(dir.path(), 1).unwrap();
    let files = event_files(dir.path());
    assert_eq!(files.len(), 2);
    assert_eq!(files[1], log.events_path());
    let records = read_records(&files[1]);
    assert_eq!(records.len(), 2);
    let start = decode(&records[1]);
    assert_eq!(start[1], (2, Field::Varint(2)));
    assert_eq!(start[2], (7, Field::Bytes(vec![0x08, 0x01])));

    // A new run in the folder restarts at step 0.
    drop(log);
    let log = MetricsLog::create(dir.path()).unwrap();
    let files = event_files(dir.path());
    assert_eq!(files.len(), 3);
    assert_eq!(files[2], log.events_path());
    let records = read_records(&files[2]);
    assert_eq!(records.len(), 2);
    assert_eq!(decode(&records[1])[1], (2, Field::Varint(0)));

    // A resume in a folder without event files has nothing to restart.
    let fresh = crate::common::tempdir::Dir::new("events-fresh");
    let log = MetricsLog::resume(fresh.path(), 4).unwrap();
    assert_eq!(read_records(log.events_path()).len(), 1);
}

const TENSORBOARD_READER: &str = r#"
import json, os, sys
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

folder = sys.argv[1]
files = []
for name in sorted(os.listdir(folder)):
    # The raw reader checks both CRCs of every record and raises on a mismatch.
    reader = PyRecordReader_New(os.path.join(folder, name))
    kinds = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            break
        event = event_pb2.Event.FromString(reader.record())
        kind = event.WhichOneof("what")
        if kind == "session_log":
            kind = "session_log:%s@%d" % (event_pb2.SessionLog.SessionStatus.Name(event.session_log.status), event.step)
        elif kind == "file_version":
            kind = "file_version:" + event.file_version
        kinds.append(kind)
    files.append(kinds)

accumulator = ea.EventAccumulator(folder, size_guidance={ea.SCALARS: 0}, purge_orphaned_data=True)
accumulator.Reload()
scalars = {tag: [[e.step, e.value] for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
print(json.dumps({"files": files, "scalars": scalars}, sort_keys=True))
"#;

/// What TensorBoard reads in `run_dir/tensorboard/`: each file's events (`summary`, or the
/// `file_version` and `session_log` they hold) and the scalars TensorBoard shows, or `None` when the
/// peers' venv with TensorBoard is not installed (`components::peers`).
fn tensorboard_read(test: &str, run_dir: &Path) -> Option<serde_json::Value> {
    let python = crate::common::components::peers(&["tensorboard"])?;
    let output = Command::new(&python)
        .arg("-c")
        .arg(TENSORBOARD_READER)
        .arg(run_dir.join("tensorboard"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    println!("{test}: TensorBoard read {stdout}");
    Some(serde_json::from_str(stdout.trim()).unwrap())
}

/// The events of a file as `tensorboard_read` lists them: `first`, then `summaries` summaries.
fn file_events(first: &[&str], summaries: usize) -> serde_json::Value {
    let mut events: Vec<&str> = first.to_vec();
    events.extend(std::iter::repeat_n("summary", summaries));
    serde_json::json!(events)
}

const VERSION: &str = "file_version:brain.Event:2";

#[test]
fn tensorboard_reads_the_events_and_purges_steps_after_a_resume() {
    let dir = crate::common::tempdir::Dir::new("tensorboard");
    let mut log = MetricsLog::create(dir.path()).unwrap();
    for step in 1..=5 {
        let mut row = metrics(&[("reward", step as f64 + 0.5)]);
        if step % 2 == 0 {
            row.insert("eval/pass@1".into(), step as f64 / 8.0);
        }
        log.log(step, &row).unwrap();
    }
    drop(log);
    // Resumed from the checkpoint of step 3: steps 4 and 5 are written again, with other values.
    let mut log = MetricsLog::resume(dir.path(), 3).unwrap();
    for step in 4..=6 {
        let mut row = metrics(&[("reward", step as f64 * 10.0 + 0.25)]);
        if step % 2 == 0 {
            row.insert("eval/pass@1".into(), 1.0);
        }
        log.log(step, &row).unwrap();
    }

    let test = "tensorboard_reads_the_events_and_purges_steps_after_a_resume";
    let Some(read) = tensorboard_read(test, dir.path()) else {
        return;
    };
    assert_eq!(
        read["files"],
        serde_json::json!([
            file_events(&[VERSION], 7),
            file_events(&[VERSION, "session_log:START@4"], 5),
        ])
    );
    assert_eq!(
        read["scalars"],
        serde_json::json!({
            "reward": [[1, 1.5], [2, 2.5], [3, 3.5], [4, 40.25], [5, 50.25], [6, 60.25]],
            "eval/pass@1": [[2, 0.25], [4, 1.0], [6, 1.0]],
        })
    );
}

#[test]
fn tensorboard_shows_only_the_new_run_of_a_reused_folder() {
    let dir = crate::common::tempdir::Dir::new("tensorboard-new-run");
    let mut log = MetricsLog::create(dir.path()).unwrap();
    for step in 1..=3 {
        log.log(step, &metrics(&[("reward", 0.5), ("old", 1.0)]))
            .unwrap();
    }
    drop(log);
    let mut log = MetricsLog::create(dir.path()).unwrap();
    for step in 1..=2 {
        log.log(step, &metrics(&[("reward", 0.75)])).unwrap();
    }

    let test = "tensorboard_shows_only_the_new_run_of_a_reused_folder";
    let Some(read) = tensorboard_read(test, dir.path()) else {
        return;
    };
    assert_eq!(
        read["files"],
        serde_json::json!([
            file_events(&[VERSION], 6),
            file_events(&[VERSION, "session_log:START@0"], 2),
        ])
    );
    assert_eq!(
        read["scalars"],
        serde_json::json!({"reward": [[1, 0.75], [2, 0.75]], "old": []})
    );
}

fn png_size(path: &Path) -> (u32, u32) {
    let file = std::io::BufReader::new(fs::File::open(path).unwrap());
    let mut reader = png::Decoder::new(file).read_info().unwrap();
    let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
    let frame = reader.next_frame(&mut pixels).unwrap();
    let drawn = pixels[..frame.buffer_size()]
        .iter()
        .filter(|&&b| b < 128)
        .count();
    assert!(drawn > 1000, "{}: only {drawn} dark bytes", path.display());
    (frame.width, frame.height)
}

#[test]
fn plot_run_writes_a_png_per_metric_and_an_overview() {
    let dir = crate::common::tempdir::Dir::new("plot");
    let mut log = MetricsLog::create(dir.path()).unwrap();
    for step in 0..=40u64 {
        let t = step as f64;
        let mut row = metrics(&[
            ("reward", 1.0 - (-t / 12.0).exp() + 0.05 * (t * 1.7).sin()),
            ("loss", 0.02 * (t * 0.9).cos()),
            ("learning_rate", 1e-6 * (1.0 - t / 40.0)),
            ("completions/mean_length", 180.0 + 40.0 * (t / 9.0).sin()),
            ("always_nan", f64::NAN),
        ]);
        if step % 10 == 0 {
            row.insert("eval/pass@1".into(), (t / 50.0).min(1.0));
        }
        if step == 40 {
            // A chart of one point.
            row.insert("eval/failed".into(), 2.0);
        }
        log.log(step, &row).unwrap();
    }
    let written = plot_run(dir.path()).unwrap();
    let plots = dir.path().join("plots");
    let names: Vec<&str> = written
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "completions_mean_length.png",
            "eval_failed.png",
            "eval_pass@1.png",
            "learning_rate.png",
            "loss.png",
            "reward.png",
            "overview.png"
        ]
    );
    for path in &written {
        assert_eq!(path.parent().unwrap(), plots);
        let bytes = fs::read(path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}", path.display());
        let expected = if path.ends_with("overview.png") {
            (1800, 760)
        } else {
            (900, 520)
        };
        assert_eq!(png_size(path), expected, "{}", path.display());
    }
}

#[test]
fn plot_run_errors_name_the_file_and_the_problem() {
    let dir = crate::common::tempdir::Dir::new("plot-errors");
    let path = dir.path().join("metrics.jsonl");
    let error = plot_run(dir.path()).unwrap_err();
    assert!(
        error.starts_with(&path.display().to_string()) && error.contains("no such file"),
        "{error}"
    );

    fs::write(&path, "{\"step\":1,\"loss\":0.5}\n{\"step\":2,\"loss\":}\n").unwrap();
    let error = plot_run(dir.path()).unwrap_err();
    assert!(
        error.starts_with(&format!("{}:2:", path.display())),
        "{error}"
    );

    fs::write(&path, "{\"step\":1}\n{\"step\":2,\"loss\":null}\n").unwrap();
    let error = plot_run(dir.path()).unwrap_err();
    assert!(
        error.starts_with(&path.display().to_string()) && error.contains("no metrics"),
        "{error}"
    );
    assert!(!dir.path().join("plots").exists());
}
