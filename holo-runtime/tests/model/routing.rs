//! Mixture-of-experts routing: what the sampler records is what a training pass routes, and routing
//! replay makes a trainer compute sampled tokens through the sampler's experts even where its own
//! arithmetic would route them elsewhere.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use holo_runtime::local::files;
use holo_runtime::local::generate::{generate, Generation, GenerationParams, Stopping};
use holo_runtime::local::model::{Routes, Routing, UNROUTED};
use holo_runtime::local::{Layout, Limits, LocalModel, LocalOptions, Model, Ops};
use holo_runtime::sampler::Request;

use crate::common;

/// The mixture-of-experts fixtures: Qwen3-MoE's softmax then top-k, gpt-oss's top-k then softmax,
/// Qwen3.5's as Qwen3-MoE's beside linear attention and a shared expert.
const FAMILIES: [&str; 3] = ["qwen3_moe", "gpt_oss", "qwen3_5_moe"];

fn fixture(family: &str) -> std::path::PathBuf {
    common::repo()
        .join("holo-runtime/tests/fixtures/models")
        .join(family)
}

fn moe(family: &str) -> (Model, tokenizers::Tokenizer) {
    let dir = fixture(family);
    let model = files::load_model(&dir, DType::F32, &Device::Cpu).unwrap();
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    (model, tokenizer)
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![510, 77, 301, 12],
        vec![14, 200, 9, 88, 431, 7, 510, 66, 3],
        vec![300],
    ]
}

/// `prompts` with their generations through `model`, recording routes.
fn sample(
    model: &Model,
    tokenizer: &tokenizers::Tokenizer,
    temperature: f64,
    seed: u64,
) -> Vec<Generation> {
    let prompts = prompts();
    let params: Vec<GenerationParams> = (0..prompts.len())
        .map(|row| GenerationParams {
            max_tokens: 16,
            temperature,
            seed: seed + row as u64,
            record_routes: true,
            ..GenerationParams::default()
        })
        .collect();
    let stopping = Stopping {
        eos: &[],
        tokenizer,
    };
    generate(model, &stopping, &prompts, &params, None).unwrap()
}

/// The sequences (prompt, then every sampled token) of a sampling run, right-padded with 0, and their
/// key mask.
fn rows(generations: &[Generation]) -> (Vec<Vec<u32>>, Tensor, Tensor) {
    let sequences: Vec<Vec<u32>> = prompts()
        .into_iter()
        .zip(generations)
        .map(|(mut prompt, generation)| {
            prompt.extend(&generation.tokens);
            prompt
        })
        .collect();
    let width = sequences.iter().map(Vec::len).max().unwrap();
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    for sequence in &sequences {
        ids.extend(
            sequence
                .iter()
                .copied()
                .chain(std::iter::repeat(0))
                .take(width),
        );
        mask.extend((0..width).map(|column| u8::from(column < sequence.len())));
    }
    let shape = (sequences.len(), width);
    (
        sequences,
        Tensor::from_vec(ids, shape, &Device::Cpu).unwrap(),
        Tensor::from_vec(mask, shape, &Device::Cpu).unwrap(),
    )
}

/// The log-probability of every sampled token under `model` in a training pass over `ids` laid out by
/// `layout` (the sampled tokens follow each row's prompt).
fn sampled_logprobs(
    model: &Model,
    ids: &Tensor,
    layout: &Layout,
    generations: &[Generation],
) -> Vec<Vec<f64>> {
    let hidden = model
        .forward_hidden_in(ids, layout, Ops::Differentiable)
        .unwrap();
    let logits = model.logits(&hidden, Ops::Differentiable).unwrap();
    let logprobs = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    prompts()
        .iter()
        .zip(generations)
        .enumerate()
        .map(|(row, (prompt, generation))| {
            let row_logprobs = logprobs.get(row).unwrap();
            generation
                .tokens
                .iter()
                .enumerate()
                .map(|(i, &token)| {
                    let position = prompt.len() + i - 1;
                    row_logprobs
                        .get(position)
                        .unwrap()
                        .get(token as usize)
                        .unwrap()
                        .to_scalar::<f64>()
                        .unwrap()
                })
                .collect()
        })
        .collect()
}

/// The recorded routes of a run, as a training pass over [`rows`] replays them.
fn replay_of(
    sequences: &[Vec<u32>],
    generations: &[Generation],
    width: usize,
    model: &Model,
) -> Routes {
    let mut tokens: Vec<&[u32]> = Vec::new();
    for (sequence, generation) in sequences.iter().zip(generations) {
        for column in 0..width {
            tokens.push(match generation.routes.get(column) {
                Some(routes) if column < sequence.len() => routes,
                _ => &[],
            });
        }
    }
    Routes::from_tokens(tokens.into_iter(), &model.config).unwrap()
}

/// The final hidden states of `ids` in rows under `mask`, routed by `routing`.
fn routed(model: &Model, ids: &Tensor, mask: &Tensor, routing: &Arc<Routing>) -> Tensor {
    let layout = Layout::causal(mask)
        .unwrap()
        .with_routing(Arc::clone(routing));
    model
        .forward_hidden_in(ids, &layout, Ops::Differentiable)
        .unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn the_sampler_records_the_routes_a_training_pass_takes() {
    for family in FAMILIES {
        sampler_records_the_routes_a_training_pass_takes(family);
    }
}

fn sampler_records_the_routes_a_training_pass_takes(family: &str) {
    let (model, tokenizer) = moe(family);
    let generations = sample(&model, &tokenizer, 0.0, 0);
    let experts = model.config.experts.unwrap();
    let mixtures = model.config.layers.iter().filter(|l| l.experts).count();
    let (sequences, ids, mask) = rows(&generations);
    let routing = Arc::new(Routing::record());
    routed(&model, &ids, &mask, &routing);
    let width = ids.dim(1).unwrap();
    let taken = routing.taken().per_token(sequences.len() * width);
    for (row, (sequence, generation)) in sequences.iter().zip(&generations).enumerate() {
        // Every token the sampler read: the prompt, then each sampled token but the last.
        assert_eq!(generation.routes.len(), sequence.len() - 1, "row {row}");
        for (position, recorded) in generation.routes.iter().enumerate() {
            assert_eq!(
                recorded.len(),
                mixtures * experts.per_token,
                "{family} row {row}"
            );
            assert_eq!(
                recorded,
                &taken[row * width + position],
                "{family} row {row}, position {position}: the sampler routed otherwise than the \
                 training pass"
            );
        }
    }
    // Without asking, nothing is recorded.
    let prompts = prompts();
    let stopping = Stopping {
        eos: &[],
        tokenizer: &tokenizer,
    };
    let plain = generate(
        &model,
        &stopping,
        &prompts[..1],
        &[GenerationParams::default()],
        None,
    )
    .unwrap();
    assert!(plain[0].routes.is_empty());
}

/// Through the scheduler as `holo train` samples: prompts prefilled in chunks of a few tokens, a third
/// sequence joining the running batch when a row frees up; every completion's routes are what a
/// training pass over its tokens routes.
#[test]
fn the_schedulers_chunked_prefill_and_joining_rows_record_every_token() {
    for family in FAMILIES {
        scheduler_records_every_token(family);
    }
}

fn scheduler_records_every_token(family: &str) {
    let dir = fixture(family);
    let options = LocalOptions {
        limits: Limits {
            max_num_seqs: 2,
            max_num_batched_tokens: 4,
            ..Limits::default()
        },
        record_routes: true,
        ..LocalOptions::default()
    };
    let sampler = LocalModel::load(&dir, options).unwrap();
    let (model, _) = moe(family);
    let requests: Vec<Request> = prompts()
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| common::logits::greedy_request(prompt, 6 + i))
        .collect();
    let completions: Vec<_> = sampler
        .sample_blocking(&requests)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    for (row, (prompt, completion)) in prompts().iter().zip(&completions).enumerate() {
        let mut sequence = prompt.clone();
        sequence.extend(&completion.tokens);
        let ids = Tensor::new(&sequence[..sequence.len() - 1], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let mask = ids.ones_like().unwrap().to_dtype(DType::U8).unwrap();
        let routing = Arc::new(Routing::record());
        routed(&model, &ids, &mask, &routing);
        let taken = routing.taken().per_token(sequence.len() - 1);
        assert_eq!(completion.routes, taken, "{family} row {row}");
    }
}

#[test]
fn replaying_the_routers_own_choices_changes_nothing_and_other_choices_change_the_output() {
    for family in FAMILIES {
        replaying_changes_nothing_and_other_choices_change_the_output(family);
    }
}

fn replaying_changes_nothing_and_other_choices_change_the_output(family: &str) {
    let (model, tokenizer) = moe(family);
    let mixtures = model.config.layers.iter().filter(|l| l.experts).count();
    let (_, ids, mask) = rows(&sample(&model, &tokenizer, 0.0, 0));
    let recorded = Arc::new(Routing::record());
    let own = routed(&model, &ids, &mask, &recorded);
    let taken = recorded.taken();
    let replaying = Arc::new(Routing::replay(taken.clone()));
    let replayed = routed(&model, &ids, &mask, &replaying);
    assert_eq!(max_abs_diff(&own, &replayed), 0.0, "{family}");
    let drift = replaying.drift();
    assert_eq!(
        (drift.differ, drift.compared),
        (0, mixtures * ids.elem_count()),
        "{family}"
    );

    // Every token but the first sent to other experts in the first mixture layer (the next ids round
    // the circle); the first token left to its router there.
    let count = model.config.experts.unwrap().count as u32;
    let k = model.config.experts.unwrap().per_token;
    let mut other = taken.clone();
    for id in &mut other.0[0][k..] {
        *id = (*id + 1) % count;
    }
    other.0[0][..k].fill(UNROUTED);
    let replaying = Arc::new(Routing::replay(other));
    let moved = routed(&model, &ids, &mask, &replaying);
    let change = max_abs_diff(&own, &moved);
    assert!(change > 1e-3, "{family}: {change}");
    let drift = replaying.drift();
    assert_eq!(
        drift.compared,
        mixtures * ids.elem_count() - 1,
        "{family}: the unrouted token is not compared"
    );
    assert!(drift.differ >= ids.elem_count() - 1, "{family}: {drift:?}");
    assert_eq!(
        replaying.taken().0[0][..k],
        taken.0[0][..k],
        "the router chose the unrouted token's experts"
    );

    // Routes of the wrong size are refused, saying which layer.
    let mut short = taken;
    short.0[0].pop();
    let error = model
        .forward_hidden_in(
            &ids,
            &Layout::causal(&mask)
                .unwrap()
                .with_routing(Arc::new(Routing::replay(short))),
            Ops::Differentiable,
        )
        .unwrap_err()
        .to_string();
    assert!(error.contains("layer 0"), "{family}: {error}");
}

/// A sampler whose arithmetic differs from the trainer's (bf16 here, as an inference engine's kernels
/// differ on a GPU) routes some tokens to other experts than the trainer's f32 routers would; the
/// trainer's log-probabilities of the sampled tokens then jump where it does. Replaying the sampler's
/// routes removes those jumps: what is left is the arithmetic's own difference. Not on Qwen3.5's
/// mixture, whose bf16 arithmetic alone (the routes replayed) moves its log-probabilities by up to 6.0
/// (mean 0.24), against 8.4 (0.57) with the trainer's own routing: short of the fourfold drop asked
/// here, so the comparison cannot tell the routes' part from the arithmetic's.
#[test]
fn routing_replay_brings_the_trainers_logprobs_to_the_samplers() {
    for family in FAMILIES
        .into_iter()
        .filter(|&family| family != "qwen3_5_moe")
    {
        replay_brings_the_trainers_logprobs_to_the_samplers(family);
    }
}

fn replay_brings_the_trainers_logprobs_to_the_samplers(family: &str) {
    let (model, tokenizer) = moe(family);
    let sampler = model.to_dtype(DType::BF16).unwrap();
    let mut own_deltas = Vec::new();
    let mut replay_deltas = Vec::new();
    let (mut differ, mut compared) = (0, 0);
    for seed in 0..6 {
        let generations = sample(&sampler, &tokenizer, 1.0, seed * 10);
        let (sequences, ids, mask) = rows(&generations);
        let width = ids.dim(1).unwrap();
        let own = sampled_logprobs(&model, &ids, &Layout::causal(&mask).unwrap(), &generations);
        let routing = Arc::new(Routing::replay(replay_of(
            &sequences,
            &generations,
            width,
            &model,
        )));
        let layout = Layout::causal(&mask).unwrap().with_routing(routing.clone());
        let replayed = sampled_logprobs(&model, &ids, &layout, &generations);
        let drift = routing.drift();
        differ += drift.differ;
        compared += drift.compared;
        for ((generation, own), replayed) in generations.iter().zip(own).zip(replayed) {
            for ((&sampled, own), replayed) in generation.logprobs.iter().zip(own).zip(replayed) {
                own_deltas.push((own - sampled as f64).abs());
                replay_deltas.push((replayed - sampled as f64).abs());
            }
        }
    }
    let stats = |deltas: &[f64]| {
        let mean = deltas.iter().sum::<f64>() / deltas.len() as f64;
        let max = deltas.iter().cloned().fold(0.0, f64::max);
        (mean, max)
    };
    let (own_mean, own_max) = stats(&own_deltas);
    let (replay_mean, replay_max) = stats(&replay_deltas);
    println!(
        "{family}: bf16 sampler vs f32 trainer over {} sampled tokens: |Δ log p| mean {own_mean:.3e} max \
         {own_max:.3e} with the trainer's own routing; mean {replay_mean:.3e} max {replay_max:.3e} \
         with routing replay; the trainer's routers differ on {differ} of {compared} replayed \
         token × layer choices",
        own_deltas.len()
    );
    assert!(
        differ > 0,
        "{family}: the sampler's arithmetic never changed a routing: nothing was tested"
    );
    assert!(
        replay_max * 4.0 < own_max && replay_mean < own_mean,
        "{family}: replay: mean {replay_mean} max {replay_max}; own routing: mean {own_mean} max \
         {own_max}"
    );
}
