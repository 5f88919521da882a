//! Phi-3's LongRoPE switch point as transformers 5.23 takes it (`scripts/longrope_fixtures.py`): a forward
//! pass rotates every position by the long factors when its sequence is longer than
//! `original_max_position_embeddings` (64 here), and `generate` runs the whole sequence again at the first
//! token past it, so each sampled token's log-probability is that of one forward over the sequence so far.
//! The scheduler does the same per row: a prompt prefilled in chunks takes the factors of its whole length,
//! a row crossing the switch runs again, rows on either side of it share a batch, and the prefix cache
//! does not hand keys rotated by one set of factors to a prompt of the other.
//!
//!     ~/.cache/holo-peers/venv/bin/python scripts/longrope_fixtures.py
//!     cargo test -p holo-runtime --test model longrope

use candle_core::{DType, Tensor};
use holo_runtime::local::{Limits, LocalModel, LocalOptions, Ops};
use holo_runtime::machine::Completion;
use holo_runtime::sampler::{Prompt, Request, SampleParams};
use serde_json::Value;

use crate::common::json::{floats, ids};
use crate::common::repo;

const MODEL: &str = "holo-runtime/tests/fixtures/models/phi3";

fn expected() -> Value {
    let text = std::fs::read_to_string(repo().join(MODEL).join("longrope.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn load(limits: Limits) -> LocalModel {
    let options = LocalOptions {
        limits,
        ..LocalOptions::default()
    };
    LocalModel::load(repo().join(MODEL), options).unwrap()
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        prompt: Prompt::Tokens(prompt),
        params: SampleParams {
            max_tokens: Some(max_tokens as u32),
            temperature: Some(0.0),
            ignore_eos: true,
            ..SampleParams::default()
        },
    }
}

/// The greedy run of `run` (a fixture entry) matches transformers' tokens, and its log-probabilities
/// within 1e-4.
fn assert_matches(completion: &Completion, run: &Value, what: &str) {
    let name = run["name"].as_str().unwrap();
    assert_eq!(completion.tokens, ids(&run["greedy"]), "{what}: {name}");
    let expected = floats(&run["logprobs"]);
    for (step, (ours, theirs)) in completion.logprobs.iter().zip(&expected).enumerate() {
        assert!(
            (ours - theirs).abs() < 1e-4,
            "{what}: {name}, step {step}: {ours} against transformers' {theirs} \
             ({:?} against {expected:?})",
            completion.logprobs
        );
    }
}

fn requests(expected: &Value) -> Vec<Request> {
    expected["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|run| greedy(ids(&run["prompt"]), run["greedy"].as_array().unwrap().len()))
        .collect()
}

#[test]
fn sampling_switches_to_the_long_factors_as_transformers_generate_does() {
    let expected = expected();
    let runs = expected["runs"].as_array().unwrap();
    let requests = requests(&expected);
    let chunked = Limits {
        max_num_batched_tokens: 16,
        ..Limits::default()
    };
    for (limits, what) in [(Limits::default(), "whole"), (chunked, "chunked")] {
        let model = load(limits);
        // Alone, then together: a batch of a short row crossing the switch and a long one.
        for (request, run) in requests.iter().zip(runs) {
            let completion = model
                .sample_blocking(std::slice::from_ref(request))
                .pop()
                .unwrap()
                .unwrap();
            assert_matches(&completion, run, what);
        }
        let together = model.sample_blocking(&requests);
        for (completion, run) in together.into_iter().zip(runs) {
            assert_matches(&completion.unwrap(), run, &format!("{what}, batched"));
        }
    }
}

#[test]
fn a_prompt_does_not_start_from_keys_of_the_other_factors() {
    // The crossing run's sequence (72 tokens) enters the prefix cache with long keys; its 60-token
    // prompt again must not start from them, nor a 70-token extension of a short sequence from short
    // ones.
    let expected = expected();
    let runs = expected["runs"].as_array().unwrap();
    let crossing = &runs[0];
    let model = load(Limits::default());
    let request = greedy(ids(&crossing["prompt"]), 12);
    for attempt in ["first", "again, after its sequence was cached"] {
        let completion = model
            .sample_blocking(std::slice::from_ref(&request))
            .pop()
            .unwrap()
            .unwrap();
        assert_matches(&completion, crossing, attempt);
    }
    assert!(
        model.prefix_cache().tokens() > 0,
        "the cache kept a sequence"
    );

    let model = load(Limits::default());
    let prompt = ids(&crossing["prompt"]);
    let short = greedy(prompt[..40].to_vec(), 1);
    model.sample_blocking(&[short]).pop().unwrap().unwrap();
    let mut longer = prompt[..40].to_vec();
    longer.extend((0..30).map(|i| (i * 13 % 500) as u32));
    let reused = model
        .sample_blocking(&[greedy(longer.clone(), 2)])
        .pop()
        .unwrap()
        .unwrap();
    let fresh = load(Limits::default())
        .sample_blocking(&[greedy(longer, 2)])
        .pop()
        .unwrap()
        .unwrap();
    assert_eq!(reused.tokens, fresh.tokens);
    for (a, b) in reused.logprobs.iter().zip(&fresh.logprobs) {
        assert!(
            (a - b).abs() < 1e-5,
            "{:?} against {:?}",
            reused.logprobs,
            fresh.logprobs
        );
    }
}

#[test]
fn a_forward_past_the_switch_takes_the_long_factors_everywhere() {
    let expected = expected();
    let forward = &expected["forward"];
    let sequence = ids(&forward["ids"]);
    let model = load(Limits::default());
    let device = model.model().device().clone();
    let input = Tensor::new(sequence.as_slice(), &device)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mask = Tensor::ones((1, sequence.len()), DType::U8, &device).unwrap();
    let ours = model
        .model()
        .token_logprobs(&input, &mask, Ops::Fast)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let theirs = floats(&forward["logprobs"]);
    assert_eq!(ours.len(), theirs.len());
    let drift = ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(drift < 1e-4, "largest difference {drift}");
}
