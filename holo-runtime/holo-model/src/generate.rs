//! Batched sampling with a KV cache: many prompts of different lengths at once, each row with its own
//! sampling parameters, seed, stop strings and length ([`sample`](super::sample)), run as one
//! submission of the [scheduler](super::schedule) to the end.

use super::model::{Model, Result};
pub use super::sample::{Generation, GenerationParams, PrefixCache, Stopping};
use super::schedule::{Engine, Limits, Listener};

/// Samples a continuation of every prompt. Prompts must be non-empty. With a `prefix` cache, prompts
/// that extend a sequence run before only run their new tokens, and every finished row's sequence is
/// kept for the next turn.
pub fn generate(
    model: &Model,
    stopping: &Stopping,
    prompts: &[Vec<u32>],
    params: &[GenerationParams],
    prefix: Option<&PrefixCache>,
) -> Result<Vec<Generation>> {
    generate_streaming(model, stopping, prompts, params, prefix, &mut |_, _, _| {
        true
    })
}

/// [`generate`], calling `on_token(row, token, logprob)` after each step for every token sampled, in
/// order (`logprob` under the policy at temperature 1). A row for which it returns `false` ends there, as
/// if its `max_tokens` were reached. The rows run as one submission of the [scheduler](super::schedule)
/// with no limits: every prompt is prefilled at once, then all decode together.
pub fn generate_streaming(
    model: &Model,
    stopping: &Stopping,
    prompts: &[Vec<u32>],
    params: &[GenerationParams],
    prefix: Option<&PrefixCache>,
    on_token: &mut dyn FnMut(usize, u32, f32) -> bool,
) -> Result<Vec<Generation>> {
    assert_eq!(prompts.len(), params.len(), "one parameter set per prompt");
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        candle_core::bail!("prompt {i} is empty");
    }
    let limits = Limits {
        max_num_seqs: prompts.len(),
        max_num_batched_tokens: usize::MAX,
        kv_budget_bytes: usize::MAX,
        batch_invariant: false,
    };
    let engine = Engine::new(model, *stopping, prefix, limits);
    run(engine, prompts, params, on_token)
}

/// Runs the prompts as one submission of `engine` to the end.
fn run<'a>(
    mut engine: Engine<'a>,
    prompts: &[Vec<u32>],
    params: &[GenerationParams],
    on_token: &'a mut dyn FnMut(usize, u32, f32) -> bool,
) -> Result<Vec<Generation>> {
    let sequences = prompts
        .iter()
        .cloned()
        .zip(params.iter().cloned())
        .collect();
    engine.submit(sequences, Box::new(Callback(on_token)));
    loop {
        if let Some((_, results)) = engine.step().pop() {
            return results
                .into_iter()
                .map(|result| result.map_err(candle_core::Error::Msg))
                .collect();
        }
    }
}

/// A callback as the scheduler's listener.
struct Callback<'f>(&'f mut dyn FnMut(usize, u32, f32) -> bool);

impl Listener for Callback<'_> {
    fn token(&mut self, index: usize, token: u32, logprob: f32, _top: &[(u32, f32)]) -> bool {
        (self.0)(index, token, logprob)
    }

    fn wanted(&self, _index: usize) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, ModelConfig};

    /// The engine drawing on the device (as on a GPU; here the CPU's tensors) samples what it samples
    /// drawing on the host, row by row, with rows that share a prompt, greedy, tempered, top-k, top-p
    /// and top-log-probability rows in one batch, over a vocabulary of several draw chunks.
    #[test]
    fn drawing_on_the_device_samples_what_the_host_samples() {
        use crate::dispatch::Draws;
        use crate::testing::{config, random_model};

        let config = ModelConfig {
            vocab_size: 2 * super::super::draw::CHUNK + 300,
            ..config(Arch::Qwen2)
        };
        let model = random_model(&config, candle_core::DType::F32);
        let tokenizer = crate::init::build_tokenizer().unwrap();
        let stopping = Stopping {
            eos: &[],
            tokenizer: &tokenizer,
        };
        let sampled = |seed, temperature, max_tokens| GenerationParams {
            seed,
            temperature,
            max_tokens,
            ..Default::default()
        };
        let params = vec![
            sampled(1, 1.0, 12),
            sampled(2, 1.0, 7),
            sampled(3, 0.0, 12),
            sampled(4, 0.6, 12),
            sampled(5, 1.7, 9),
            GenerationParams {
                top_k: 5,
                ..sampled(6, 1.0, 12)
            },
            GenerationParams {
                top_p: 0.8,
                ..sampled(7, 0.9, 12)
            },
            GenerationParams {
                top_logprobs: 3,
                ..sampled(8, 1.0, 12)
            },
            // A constrained row, drawn on the host from its masked logits in either engine (its
            // language has no sentence shorter than 30 letters: it runs to its length).
            GenerationParams {
                constraint: Some(
                    crate::Grammars::new(
                        tokenizer.clone(),
                        config.vocab_size,
                        vec![tokenizer.token_to_id("<|im_end|>").unwrap()],
                    )
                    .compile(&holo_core::Constraint::Regex("[a-z]{30}".into()))
                    .unwrap(),
                ),
                ..sampled(9, 1.0, 12)
            },
        ];
        let prompts: Vec<Vec<u32>> = [
            &[5u32, 9, 14][..],
            &[5, 9, 14],
            &[7, 1000, 2000, 3],
            &[5, 9, 14],
            &[2100],
            &[7, 1000, 2000, 3],
            &[11, 12],
            &[5, 9, 14],
            &[5, 9, 14],
        ]
        .iter()
        .map(|prompt| prompt.to_vec())
        .collect();
        let limits = Limits {
            max_num_seqs: prompts.len(),
            max_num_batched_tokens: usize::MAX,
            kv_budget_bytes: usize::MAX,
            batch_invariant: false,
        };
        let generate = |draws| {
            let engine = Engine::new(&model, stopping, None, limits).drawing(draws);
            run(engine, &prompts, &params, &mut |_, _, _| true).unwrap()
        };
        let (host, device) = (generate(Draws::Host), generate(Draws::Device));
        let close = |a: &[f32], b: &[f32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(a, b)| (a - b).abs() < 1e-4)
        };
        for (i, (host, device)) in host.iter().zip(&device).enumerate() {
            assert_eq!(host.tokens, device.tokens, "row {i}");
            assert_eq!(host.tokens.len(), params[i].max_tokens, "row {i}");
            assert!(close(&host.logprobs, &device.logprobs), "row {i}");
            assert!(
                close(&host.sampling_logprobs, &device.sampling_logprobs),
                "row {i}"
            );
            assert_eq!(host.top_logprobs, device.top_logprobs, "row {i}");
            assert_eq!(host.text, device.text, "row {i}");
        }
        // The rows are not all alike: the sampled ones differ from the greedy one on a shared prompt.
        assert_ne!(host[0].tokens, host[3].tokens);
        assert_eq!(host[7].top_logprobs.len(), 12);
        assert!(
            (12..=30).contains(&host[8].text.len())
                && host[8].text.bytes().all(|b| b.is_ascii_lowercase()),
            "{:?}",
            host[8].text
        );
    }
}
