//! What the Holophore and native-tool tests share: a sampler wrapper that keeps every request with the
//! completion it got, and one row run through the Loom.

use std::sync::Mutex;

use holo_core::interpreter::Row;
use holo_core::loom::{Loom, RolloutRecord, RolloutSource, Summary};
use holo_core::sampler::SampleFuture;
use holo_core::{Completion, Request, Sampler};

/// `loom` run on the one row `row` (a JSON object) with `sampler`, on a current-thread runtime: the
/// run's summary and the rollout's record.
pub fn run_row<S: RolloutSource, P: Sampler>(
    loom: &Loom<S>,
    row: &str,
    sampler: &P,
) -> (Summary, RolloutRecord) {
    let row: Row = serde_json::from_str(row).unwrap();
    let mut records: Vec<RolloutRecord> = Vec::new();
    let summary = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(loom.run(&[(0, row)], sampler, &mut records))
        .unwrap();
    (summary, records.remove(0))
}

/// Wraps a sampler and keeps every request with the completion it got.
pub struct Recording<S> {
    pub inner: S,
    pub seen: Mutex<Vec<(Request, Completion)>>,
}

impl<S: Sampler> Sampler for Recording<S> {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        Box::pin(async move {
            let results = self.inner.sample(batch).await;
            let mut seen = self.seen.lock().unwrap();
            for (request, result) in batch.iter().zip(&results) {
                seen.push((request.clone(), result.clone().expect("scripted replies")));
            }
            results
        })
    }
}
