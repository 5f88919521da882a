//! A run's metrics, one line per step: `RUN_DIR/metrics.jsonl` and TensorBoard event files.
//!
//! - `metrics.jsonl` holds one JSON object per logged step, `{"step":N,"<name>":value,...}`, the names
//!   in sorted order after `step`. A value that is not finite (`NaN`, ±∞) is written as `null`, which
//!   [`read_metrics`] reads back as `NaN`.
//! - `tensorboard/events.out.tfevents.<unix secs>.<hostname>.<pid>.<n>` are TensorBoard event files:
//!   TFRecords (a little-endian `u64` length, the masked CRC-32C of those 8 bytes, the data, the masked
//!   CRC-32C of the data) of `Event` protocol buffers, encoded here by hand. A file opens with
//!   `Event{wall_time, file_version: "brain.Event:2"}`; each logged value is then one
//!   `Event{wall_time, step, summary{value{tag, simple_value}}}`, its tag the metric's name.
//!
//! A resumed run ([`MetricsLog::resume`]) cuts `metrics.jsonl` back to the checkpoint's step and opens a
//! new event file that starts with `SessionLog{status: START}` at the next step: TensorBoard then
//! discards the points the interrupted run wrote after the checkpoint, as it does for a restarted
//! TensorFlow job. A new run in a folder that has event files ([`MetricsLog::create`]) starts its file
//! with `SessionLog{status: START}` at step 0, so TensorBoard shows none of the older points.
//!
//! The trainer gathers a step's values in a `Window` (averaged as TRL averages its metric lists), adds
//! TRL's completion metrics, and prints completions under `log_completions`.
//!
//! Every [`MetricsLog::log`] writes whole records to both files before it returns, so a crash loses
//! no step that was logged and leaves at most a cut-short last line, which a resume drops.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::{self, Deserializer, MapAccess, Visitor};

use super::advantages::nanmean;
use super::batch::Completion;
use holo_core::loom::RolloutRecord;

/// The metrics file of a run folder.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// The folder of a run's TensorBoard event files.
pub const TENSORBOARD_DIR: &str = "tensorboard";
/// The prefix TensorBoard looks for in event file names.
const EVENTS_PREFIX: &str = "events.out.tfevents.";

/// A line of `metrics.jsonl`: the step and its metrics by name.
pub type StepMetrics = (u64, BTreeMap<String, f64>);

/// Appends a run's metrics to `metrics.jsonl` and to a TensorBoard event file.
pub struct MetricsLog {
    jsonl: File,
    jsonl_path: PathBuf,
    events: File,
    events_path: PathBuf,
}

impl MetricsLog {
    /// Starts the metrics of a new run in `run_dir` (created if missing): an empty `metrics.jsonl`
    /// (an existing one is truncated) and a new event file in `run_dir/tensorboard/`, which starts
    /// with `SessionLog{status: START}` at step 0 when older event files are there.
    pub fn create(run_dir: &Path) -> io::Result<Self> {
        fs::create_dir_all(run_dir).map_err(|e| at(run_dir, e))?;
        let jsonl_path = run_dir.join(METRICS_FILE);
        let jsonl = File::create(&jsonl_path).map_err(|e| at(&jsonl_path, e))?;
        let (events, events_path) = open_event_file(run_dir, 0)?;
        Ok(MetricsLog {
            jsonl,
            jsonl_path,
            events,
            events_path,
        })
    }

    /// Continues the metrics of a run resumed from the checkpoint of `step`.
    ///
    /// `metrics.jsonl` keeps its lines of steps up to `step` (a missing file starts empty); the lines
    /// after it and a cut-short last line are dropped, and the file is replaced atomically (a
    /// temporary file renamed over it). The new event file starts with `SessionLog{status: START}` at
    /// `step + 1` (when older event files are there), so TensorBoard purges their points of later
    /// steps.
    pub fn resume(run_dir: &Path, step: u64) -> io::Result<Self> {
        fs::create_dir_all(run_dir).map_err(|e| at(run_dir, e))?;
        let jsonl_path = run_dir.join(METRICS_FILE);
        truncate_jsonl(&jsonl_path, step)?;
        let jsonl = OpenOptions::new()
            .append(true)
            .open(&jsonl_path)
            .map_err(|e| at(&jsonl_path, e))?;
        let (events, events_path) = open_event_file(run_dir, step.saturating_add(1))?;
        Ok(MetricsLog {
            jsonl,
            jsonl_path,
            events,
            events_path,
        })
    }

    /// The event file this log writes.
    pub fn events_path(&self) -> &Path {
        &self.events_path
    }

    /// Logs the metrics of `step`: one line of `metrics.jsonl` and one TensorBoard scalar per metric,
    /// both written to the operating system before this returns. A metric named `step` is refused.
    pub fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> io::Result<()> {
        if metrics.contains_key("step") {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a metric cannot be named `step`: metrics.jsonl keeps the step under that key",
            ));
        }
        let line = jsonl_line(step, metrics);
        self.jsonl
            .write_all(line.as_bytes())
            .and_then(|()| self.jsonl.flush())
            .map_err(|e| at(&self.jsonl_path, e))?;

        let wall_time = wall_time();
        let mut records = Vec::new();
        for (tag, &value) in metrics {
            write_record(
                &mut records,
                &scalar_event(wall_time, step, tag, value as f32),
            );
        }
        self.events
            .write_all(&records)
            .and_then(|()| self.events.flush())
            .map_err(|e| at(&self.events_path, e))
    }
}

/// One line of `metrics.jsonl`, its newline included.
fn jsonl_line(step: u64, metrics: &BTreeMap<String, f64>) -> String {
    let mut line = format!("{{\"step\":{step}");
    for (name, &value) in metrics {
        // A `String` always serializes.
        let key = serde_json::to_string(name).unwrap_or_default();
        line.push(',');
        line.push_str(&key);
        line.push(':');
        // serde_json writes the shortest text that reads back as the same `f64`, and has no number
        // for one that is not finite.
        match serde_json::Number::from_f64(value) {
            Some(number) => line.push_str(&number.to_string()),
            None => line.push_str("null"),
        }
    }
    line.push_str("}\n");
    line
}

/// Keeps the lines of `path` up to `step`, dropping a last line without its newline.
fn truncate_jsonl(path: &Path, step: u64) -> io::Result<()> {
    let text = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(error) => return Err(at(path, error)),
    };
    let mut kept = Vec::with_capacity(text.len());
    // `split_inclusive` leaves a cut-short last line as the one piece without a newline.
    for (index, line) in text.split_inclusive(|&b| b == b'\n').enumerate() {
        if !line.ends_with(b"\n") {
            break;
        }
        let content = std::str::from_utf8(line).map_err(|_| {
            invalid_data(format!(
                "{}:{}: the line is not UTF-8",
                path.display(),
                index + 1
            ))
        })?;
        if content.trim().is_empty() {
            continue;
        }
        let parsed = parse_line(content).map_err(|e| invalid_data(e.at(path, index + 1)))?;
        if parsed.0 <= step {
            kept.extend_from_slice(line);
        }
    }
    let temporary = path.with_extension("jsonl.tmp");
    let mut file = File::create(&temporary).map_err(|e| at(&temporary, e))?;
    file.write_all(&kept)
        .and_then(|()| file.sync_all())
        .map_err(|e| at(&temporary, e))?;
    drop(file);
    super::kill::point("metrics:staged");
    fs::rename(&temporary, path).map_err(|e| at(path, e))
}

/// Reads a `metrics.jsonl` back: each line's step and metrics, in file order, `null` values as `NaN`.
///
/// Blank lines are skipped, and so is a last line without its newline that does not parse (one cut
/// short by a crash, or still being written). Errors name the file, the line and the column.
pub fn read_metrics(path: &Path) -> Result<Vec<StepMetrics>, String> {
    let bytes = fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        let line = valid.iter().filter(|&&b| b == b'\n').count() + 1;
        format!("{}:{line}: the line is not UTF-8", path.display())
    })?;
    let mut rows = Vec::new();
    for (index, line) in text.split_inclusive('\n').enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match parse_line(line) {
            Ok(row) => rows.push(row),
            Err(_) if !line.ends_with('\n') => break,
            Err(error) => return Err(error.at(path, index + 1)),
        }
    }
    Ok(rows)
}

/// Why a line of `metrics.jsonl` does not parse, and where in it.
struct LineError {
    column: usize,
    message: String,
}

impl LineError {
    fn at(&self, path: &Path, line: usize) -> String {
        format!(
            "{}:{line}:{}: {}",
            path.display(),
            self.column,
            self.message
        )
    }
}

fn parse_line(line: &str) -> Result<StepMetrics, LineError> {
    let mut deserializer = serde_json::Deserializer::from_str(line);
    let parsed = deserializer
        .deserialize_map(LineVisitor)
        .and_then(|row| deserializer.end().map(|()| row));
    parsed.map_err(|error| {
        let full = error.to_string();
        let position = format!(" at line {} column {}", error.line(), error.column());
        LineError {
            // serde_json counts columns from 1, but places an error at the very start at column 0.
            column: error.column().max(1),
            message: full.strip_suffix(&position).unwrap_or(&full).to_string(),
        }
    })
}

/// Reads `{"step": u64, "<name>": number or null, ...}`, so that serde_json places every error.
struct LineVisitor;

impl<'de> Visitor<'de> for LineVisitor {
    type Value = StepMetrics;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object with a `step` and numbers")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut step = None;
        let mut metrics = BTreeMap::new();
        while let Some(key) = map.next_key::<String>()? {
            if key == "step" {
                if step.is_some() {
                    return Err(de::Error::custom("`step` appears twice"));
                }
                step = Some(map.next_value::<u64>()?);
            } else {
                let value = map.next_value::<Option<f64>>()?.unwrap_or(f64::NAN);
                if metrics.insert(key.clone(), value).is_some() {
                    return Err(de::Error::custom(format!("`{key}` appears twice")));
                }
            }
        }
        let step = step.ok_or_else(|| de::Error::custom("the line has no `step`"))?;
        Ok((step, metrics))
    }
}

/// The seconds since the Unix epoch, as event files record them.
fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |elapsed| elapsed.as_secs_f64())
}

/// Opens a new event file in `run_dir/tensorboard/`, named to sort after every file already there
/// (TensorBoard reads a folder's event files in name order), and writes its first events: the file
/// version, then, when the folder has older event files, `SessionLog{status: START}` at `first_step`,
/// the step of the first point this file may hold: TensorBoard drops their points from that step on.
fn open_event_file(run_dir: &Path, first_step: u64) -> io::Result<(File, PathBuf)> {
    static FILES: AtomicU64 = AtomicU64::new(0);
    let dir = run_dir.join(TENSORBOARD_DIR);
    fs::create_dir_all(&dir).map_err(|e| at(&dir, e))?;
    let mut seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs());
    let mut restart = false;
    for entry in fs::read_dir(&dir).map_err(|e| at(&dir, e))? {
        let name = entry.map_err(|e| at(&dir, e))?.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(EVENTS_PREFIX)) else {
            continue;
        };
        restart = true;
        if let Some(older) = rest.split('.').next().and_then(|s| s.parse::<u64>().ok()) {
            seconds = seconds.max(older.saturating_add(1));
        }
    }
    let name = format!(
        "{EVENTS_PREFIX}{seconds}.{}.{}.{}",
        hostname(),
        std::process::id(),
        FILES.fetch_add(1, Ordering::Relaxed)
    );
    let path = dir.join(name);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| at(&path, e))?;
    let wall_time = wall_time();
    let mut records = Vec::new();
    write_record(&mut records, &file_version_event(wall_time));
    if restart {
        write_record(&mut records, &session_start_event(wall_time, first_step));
    }
    file.write_all(&records)
        .and_then(|()| file.flush())
        .map_err(|e| at(&path, e))?;
    Ok((file, path))
}

/// This machine's name for event file names, with nothing that could leave the folder.
fn hostname() -> String {
    let name = system_hostname().unwrap_or_default();
    let name: String = name
        .chars()
        .map(|c| if c == '/' || c == '\\' { '_' } else { c })
        .collect();
    if name.is_empty() {
        "localhost".to_string()
    } else {
        name
    }
}

#[cfg(unix)]
fn system_hostname() -> Option<String> {
    let mut buffer = [0u8; 256];
    // SAFETY: the pointer and length describe `buffer`, which outlives the call.
    let status = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) };
    if status != 0 {
        return None;
    }
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    String::from_utf8(buffer[..end].to_vec()).ok()
}

#[cfg(not(unix))]
fn system_hostname() -> Option<String> {
    std::env::var("COMPUTERNAME").ok()
}

/// Appends one TFRecord holding `data` to `out`.
fn write_record(out: &mut Vec<u8>, data: &[u8]) {
    let length = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&length);
    out.extend_from_slice(&masked_crc32c(&length).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
}

/// The CRC-32C of `data`, masked as TFRecords store it.
fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

// Field numbers of tensorflow's `Event`, `Summary`, `Summary.Value` and `SessionLog`.
const EVENT_WALL_TIME: u32 = 1;
const EVENT_STEP: u32 = 2;
const EVENT_FILE_VERSION: u32 = 3;
const EVENT_SUMMARY: u32 = 5;
const EVENT_SESSION_LOG: u32 = 7;
const SUMMARY_VALUE: u32 = 1;
const VALUE_TAG: u32 = 1;
const VALUE_SIMPLE_VALUE: u32 = 2;
const SESSION_LOG_STATUS: u32 = 1;
const SESSION_LOG_START: u64 = 1;

// Protocol buffer wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LENGTH_DELIMITED: u32 = 2;
const FIXED32: u32 = 5;

fn file_version_event(wall_time: f64) -> Vec<u8> {
    let mut event = Vec::new();
    put_double(&mut event, EVENT_WALL_TIME, wall_time);
    put_bytes(&mut event, EVENT_FILE_VERSION, b"brain.Event:2");
    event
}

fn session_start_event(wall_time: f64, step: u64) -> Vec<u8> {
    let mut session_log = Vec::new();
    put_varint_field(&mut session_log, SESSION_LOG_STATUS, SESSION_LOG_START);
    let mut event = Vec::new();
    put_double(&mut event, EVENT_WALL_TIME, wall_time);
    put_varint_field(&mut event, EVENT_STEP, step);
    put_bytes(&mut event, EVENT_SESSION_LOG, &session_log);
    event
}

fn scalar_event(wall_time: f64, step: u64, tag: &str, value: f32) -> Vec<u8> {
    let mut summary_value = Vec::new();
    put_bytes(&mut summary_value, VALUE_TAG, tag.as_bytes());
    put_key(&mut summary_value, VALUE_SIMPLE_VALUE, FIXED32);
    summary_value.extend_from_slice(&value.to_le_bytes());
    let mut summary = Vec::new();
    put_bytes(&mut summary, SUMMARY_VALUE, &summary_value);
    let mut event = Vec::new();
    put_double(&mut event, EVENT_WALL_TIME, wall_time);
    put_varint_field(&mut event, EVENT_STEP, step);
    put_bytes(&mut event, EVENT_SUMMARY, &summary);
    event
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire_type: u32) {
    put_varint(out, u64::from((field << 3) | wire_type));
}

/// An `int64` or enum field; `step` fits in an `int64` for any run that could exist.
fn put_varint_field(out: &mut Vec<u8>, field: u32, value: u64) {
    put_key(out, field, VARINT);
    put_varint(out, value);
}

fn put_double(out: &mut Vec<u8>, field: u32, value: f64) {
    put_key(out, field, FIXED64);
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, LENGTH_DELIMITED);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn at(path: &Path, error: io::Error) -> io::Error {
    io::Error::new(error.kind(), format!("{}: {error}", path.display()))
}

fn invalid_data(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

/// TRL's completion metrics: lengths (trained tokens per rollout), the truncated fraction, the lengths
/// of the rollouts that ended on their own.
pub(crate) fn completion_metrics(
    records: &[RolloutRecord],
    completions: &[Completion],
    metrics: &mut BTreeMap<String, f64>,
) {
    let lengths: Vec<f64> = completions.iter().map(|c| c.len() as f64).collect();
    let stats = |values: &[f64]| {
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (nanmean(values.iter().copied()), min, max)
    };
    let (mean, min, max) = stats(&lengths);
    metrics.insert("completions/mean_length".into(), mean);
    metrics.insert("completions/min_length".into(), min);
    metrics.insert("completions/max_length".into(), max);
    let truncated = completions.iter().filter(|c| c.truncated).count();
    metrics.insert(
        "completions/clipped_ratio".into(),
        truncated as f64 / completions.len().max(1) as f64,
    );
    let mut terminated: Vec<f64> = completions
        .iter()
        .zip(&lengths)
        .filter(|(c, _)| !c.truncated)
        .map(|(_, &length)| length)
        .collect();
    if terminated.is_empty() {
        terminated.push(0.0);
    }
    let (mean, min, max) = stats(&terminated);
    metrics.insert("completions/mean_terminated_length".into(), mean);
    metrics.insert("completions/min_terminated_length".into(), min);
    metrics.insert("completions/max_terminated_length".into(), max);
    let failed = records.iter().filter(|r| r.error.is_some()).count();
    metrics.insert(
        "rollouts/failed_ratio".into(),
        failed as f64 / records.len().max(1) as f64,
    );
}

/// Prints a generation's completions (`limit` of them, all without one) with their rewards and
/// advantages, as TRL's `log_completions` does.
pub(crate) fn print_completions(
    records: &[RolloutRecord],
    advantages: &[f64],
    limit: Option<usize>,
    step: u64,
) {
    let mut err = io::stderr().lock();
    let _ = writeln!(err, "── completions of step {step} ──");
    for (record, advantage) in records
        .iter()
        .zip(advantages)
        .take(limit.unwrap_or(usize::MAX))
    {
        let sampled: Vec<&str> = record.sampled().collect();
        let _ = writeln!(
            err,
            "row {} #{}: reward {:.3}, advantage {advantage:+.3}: {:?}",
            record.row_index,
            record.rollout_index,
            record.reward,
            sampled.join(" ⏎ ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C check value (RFC 3720, B.4): the CRC of the ASCII digits 1 to 9.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn varints_encode_as_protocol_buffers_do() {
        let mut out = Vec::new();
        put_varint(&mut out, 1);
        put_varint(&mut out, 300);
        put_varint(&mut out, u64::MAX);
        assert_eq!(
            out,
            [1, 0xac, 0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
    }

    #[test]
    fn a_scalar_event_has_the_expected_bytes() {
        let event = scalar_event(1.5, 7, "a", 2.0);
        let mut expected = vec![0x09];
        expected.extend_from_slice(&1.5f64.to_le_bytes());
        expected.extend_from_slice(&[0x10, 7, 0x2a, 10, 0x0a, 8, 0x0a, 1, b'a', 0x15]);
        expected.extend_from_slice(&2.0f32.to_le_bytes());
        assert_eq!(event, expected);
    }

    #[test]
    fn lines_write_null_for_values_that_are_not_finite() {
        let metrics = BTreeMap::from([
            ("b".to_string(), f64::NAN),
            ("a\"".to_string(), 0.1),
            ("c".to_string(), f64::NEG_INFINITY),
        ]);
        assert_eq!(
            jsonl_line(3, &metrics),
            "{\"step\":3,\"a\\\"\":0.1,\"b\":null,\"c\":null}\n"
        );
    }
}
