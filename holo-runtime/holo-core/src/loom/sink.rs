//! Where the Loom hands each rollout the moment it finishes. Whoever goes on with the records keeps them
//! (`Vec<RolloutRecord>`: the trainer, `holo dry`, the engines); whoever leaves them for later writes
//! them as they come ([`Jsonl`]: `holo eval`'s file); a pair `(a, b)` does both. Nothing reads back
//! what the Loom wrote to learn what it made.

use std::io::{self, Write};

use super::RolloutRecord;

/// Takes the Loom's records, one per finished rollout, in the order they finish.
pub trait Sink {
    /// An error stops the run; every record handed before stays where the sink put it.
    fn put(&mut self, record: RolloutRecord) -> io::Result<()>;
}

impl Sink for Vec<RolloutRecord> {
    fn put(&mut self, record: RolloutRecord) -> io::Result<()> {
        self.push(record);
        Ok(())
    }
}

impl<S: Sink + ?Sized> Sink for &mut S {
    fn put(&mut self, record: RolloutRecord) -> io::Result<()> {
        (**self).put(record)
    }
}

/// Both sinks, the first first: `(Jsonl(file), Vec::new())` writes each record and keeps it.
impl<A: Sink, B: Sink> Sink for (A, B) {
    fn put(&mut self, record: RolloutRecord) -> io::Result<()> {
        self.0.put(record.clone())?;
        self.1.put(record)
    }
}

/// Each record as one line of JSON, flushed at once: a run stopped at any moment leaves whole lines,
/// and `holo eval --resume` reads them back as the records of the rollouts already done.
#[derive(Debug)]
pub struct Jsonl<W>(pub W);

impl<W: Write> Sink for Jsonl<W> {
    fn put(&mut self, record: RolloutRecord) -> io::Result<()> {
        let mut line = serde_json::to_vec(&record).map_err(io::Error::other)?;
        line.push(b'\n');
        self.0.write_all(&line)?;
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(row_index: usize) -> RolloutRecord {
        serde_json::from_value(serde_json::json!({
            "row_index": row_index, "rollout_index": 0, "seed": 1, "row": {}, "contexts": [],
            "rewards": {}, "weights": {}, "reward": 1.0, "samples": 0, "error": null
        }))
        .unwrap()
    }

    #[test]
    fn a_pair_writes_each_record_as_a_line_and_keeps_it() {
        let mut sink = (Jsonl(Vec::new()), Vec::new());
        sink.put(record(3)).unwrap();
        sink.put(record(5)).unwrap();
        let lines: Vec<RolloutRecord> = std::str::from_utf8(&sink.0 .0)
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        assert_eq!(lines, sink.1);
        assert_eq!(
            sink.1.iter().map(|r| r.row_index).collect::<Vec<_>>(),
            [3, 5]
        );
    }
}
