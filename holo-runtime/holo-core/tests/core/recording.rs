//! A sampler wrapper the Holophore tests share: it keeps every request with the completion it got.

use std::sync::Mutex;

use holo_core::sampler::SampleFuture;
use holo_core::{Completion, Request, Sampler};

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
