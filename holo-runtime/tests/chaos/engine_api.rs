//! An engine's API that answers 5xx: an Atropos API (a loopback stub of `run-api`) whose `/batch` fails
//! before it serves a batch.
//!
//! `holo train --rollouts atropos` rides a few failures out (each request tried three times, then the
//! feed asks again) and trains on the batch that comes; an API that keeps failing stops the feed once
//! it has been failing for the reconnection's limit, with an error that names the API, the endpoint and
//! the status. (The OpenAI-compatible rollout server's 5xx: `rollout_server`.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use holo_runtime::engines::atropos::api::Retry;
use holo_runtime::engines::atropos::batch::{AtroposFeed, FeedOptions};
use holo_runtime::train::feed::Feed;
use holo_runtime::train::GrpoConfig;
use serde_json::{json, Value};

use crate::common::run_metrics;
use crate::common::tempdir::Dir;
use crate::faults::{Act, FaultServer};
use crate::support::{each_seed, fixture, run, strings};

/// A scored group of two 8-token sequences (positions 0–2 the prompt) with rewards 1 and 0.
fn group() -> Value {
    let tokens = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 13, 14, 15, 16, 17]];
    let masks: Vec<Vec<i64>> = tokens
        .iter()
        .map(|tokens| {
            tokens
                .iter()
                .enumerate()
                .map(|(at, &token)| if at < 3 { -100 } else { token })
                .collect()
        })
        .collect();
    json!({"tokens": tokens, "masks": masks, "scores": [1.0, 0.0], "env_id": 0})
}

/// A stub Atropos API serving batches of `batch` sequences whose `/batch` answers `failures` errors
/// (503, 500, 502 in turn) before its batch; the `/batch` requests it saw are counted in `asked`.
fn atropos_stub(batch: usize, failures: usize, asked: Arc<AtomicUsize>) -> FaultServer {
    FaultServer::start(move |request, _| match request.path.as_str() {
        "/register" => Act::Answer(json!({"uuid": 1}).to_string()),
        "/info" => Act::Answer(json!({"batch_size": batch, "max_token_len": 64}).to_string()),
        "/batch" => {
            let before = asked.fetch_add(1, Ordering::SeqCst);
            if before < failures {
                Act::Status([503, 500, 502][before % 3])
            } else {
                let groups: Vec<Value> = (0..batch / 2).map(|_| group()).collect();
                Act::Answer(json!({ "batch": groups }).to_string())
            }
        }
        _ => Act::Status(404),
    })
}

#[test]
fn an_atropos_api_that_answers_5xx_for_a_while_is_ridden_out_by_holo_train() {
    // Seed n: `/batch` fails n times first (three failures use up one request's tries).
    each_seed(&[1, 2, 4], |seed| {
        let failures = seed as usize;
        let asked = Arc::new(AtomicUsize::new(0));
        let api = atropos_stub(4, failures, Arc::clone(&asked));
        let dir = Dir::new("chaos-atropos-5xx");
        let out = dir.join("run");
        let args = strings(&[
            "train",
            "--rollouts",
            "atropos",
            "--api",
            &api.url,
            "--model",
            &fixture("models/qwen2"),
            "--out",
            out.to_str().unwrap(),
            "--max-steps",
            "1",
            "--num-generations",
            "2",
            "--per-device-train-batch-size",
            "4",
            "--gradient-accumulation-steps",
            "1",
        ]);
        let (code, output) = run(&dir, "atropos", &args, Duration::from_secs(60));
        assert_eq!(code, 0, "{output}");
        assert_eq!(asked.load(Ordering::SeqCst), failures + 1, "{output}");
        assert_eq!(run_metrics(&out).len(), 1, "the step trained on the batch");
        assert!(out.join("checkpoint-1/trainer_state.json").is_file());
    });
}

#[test]
fn an_atropos_api_that_keeps_answering_5xx_stops_the_feed_naming_the_status() {
    let asked = Arc::new(AtomicUsize::new(0));
    let api = atropos_stub(4, usize::MAX, Arc::clone(&asked));
    let dir = Dir::new("chaos-atropos-down");
    let mut config = GrpoConfig::default();
    config.training.max_steps = 1;
    config.num_generations = 2;
    config.training.per_device_train_batch_size = 4;
    let limit = Duration::from_secs(1);
    let options = FeedOptions {
        retry: Retry {
            attempts: 3,
            base_delay: Duration::ZERO,
            max_delay: Duration::ZERO,
        },
        poll: Duration::from_millis(20),
        reconnect_timeout: limit,
    };
    let mut feed = AtroposFeed::new(&api.url, &config, 100, 64, &dir, options).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    let error = match feed.next(&runtime, 1) {
        Ok(_) => panic!("a feed whose API only fails gave a batch"),
        Err(error) => error.to_string(),
    };
    let took = started.elapsed();
    assert!(
        took >= limit && took < limit + Duration::from_secs(10),
        "the feed gave up after {took:?}, not after its {limit:?} limit"
    );
    assert!(
        error.contains(&format!(
            "the Atropos API at {}/batch answered HTTP 5",
            api.url
        )) && error.contains("injected HTTP 5")
            && error.contains("gone for 1 s (the reconnection's limit)"),
        "{error}"
    );
    assert!(
        asked.load(Ordering::SeqCst) > 3,
        "it kept asking until the limit"
    );
}
