//! One rollout of a holoware with the built-in holotypes, answered by scripted replies.

use std::sync::Arc;

use holo_core::holotypes;
use holo_core::interpreter::{Holoware, Row};
use holo_core::{Resources, Rollout, RolloutError, Scripted, Step, Transcript};

/// Runs `source` on `row` (a JSON object) with `resources`, answering each sample with the next of
/// `replies`; the transcript, or the rollout's error.
pub fn run(
    source: &str,
    row: serde_json::Value,
    replies: &[&str],
    resources: &Resources,
) -> Result<Transcript, RolloutError> {
    let holoware = Arc::new(
        Holoware::load(
            "test.hol",
            source.as_bytes(),
            Arc::new(holotypes::registry()),
        )
        .unwrap(),
    );
    let row: Row = row.as_object().unwrap().clone();
    let mut rollout = holoware.start_with(&row, resources)?;
    let mut transcript = Transcript::default();
    let mut sampler = Scripted::new(replies.iter().copied());
    while let Step::Sample(request) = rollout.step(&mut transcript)? {
        rollout.resume(
            sampler.complete(&request).expect("enough replies"),
            &mut transcript,
        )?;
    }
    Ok(transcript)
}
