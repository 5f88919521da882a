//! vLLM's `prompt_logprobs` on the local model (the tiny Qwen2 of `tests/fixtures/models/qwen2`): every
//! prompt token's log-probability, rank and most likely alternatives are the model's own, computed here
//! without the server from the logits of the whole sequence.

use super::echo::{qwen2_dir, start_qwen2};
use super::*;
use crate::common::logits::sequence_logits;
use holo_runtime::local::{LocalModel, LocalOptions};

fn qwen2_tokenizer() -> Tokenizer {
    Tokenizer::from_file(qwen2_dir().join("tokenizer.json")).unwrap()
}

/// Log-softmax of one row of logits, in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    logits.iter().map(|&x| x as f64 - max - sum.ln()).collect()
}

/// The ranks token `id` may have in `row` (1: the most likely), counting logits within `1e-4` of its own
/// either way: the server's prefill and this whole-sequence forward may round them apart.
fn rank_bounds(row: &[f32], id: u32) -> (usize, usize) {
    let own = row[id as usize];
    let above = row.iter().filter(|&&logit| logit > own + 1e-4).count();
    let level = row.iter().filter(|&&logit| logit >= own - 1e-4).count();
    (above + 1, level)
}

/// Asserts that `scored` is vLLM's `prompt_logprobs` of `prompt` with `k` alternatives, and the model's:
/// `null` first; then per token a map whose first entry is the token's (its log-probability within 1e-4
/// of the reference, its rank the reference's), then the `k` most likely tokens (ranks 1 to k, the
/// token's own entry once), each with its log-probability and its text.
fn assert_prompt_logprobs(scored: &Value, prompt: &[u32], k: usize) {
    let positions = scored.as_array().unwrap_or_else(|| panic!("{scored:#}"));
    assert_eq!(positions.len(), prompt.len());
    assert!(positions[0].is_null());
    let model = LocalModel::load(qwen2_dir(), LocalOptions::default()).unwrap();
    let logits = sequence_logits(model.model(), prompt);
    let tokenizer = qwen2_tokenizer();
    for position in 1..prompt.len() {
        let row = &logits[position - 1];
        let reference = log_softmax(row);
        let entries = positions[position].as_object().unwrap();
        let token = prompt[position];
        let (first, _) = entries.iter().next().unwrap();
        assert_eq!(
            first,
            &token.to_string(),
            "position {position}: {entries:?}"
        );
        let in_top = entries.len() == k;
        assert!(entries.len() == k + 1 || in_top, "{entries:?}");
        let mut top_ranks = Vec::new();
        for (index, (id, entry)) in entries.iter().enumerate() {
            let id: u32 = id.parse().unwrap();
            let logprob = entry["logprob"].as_f64().unwrap();
            assert!(
                (logprob - reference[id as usize]).abs() < 1e-4,
                "position {position}, token {id}: {logprob} against {}",
                reference[id as usize]
            );
            let rank = entry["rank"].as_u64().unwrap() as usize;
            let (lowest, highest) = rank_bounds(row, id);
            assert!(
                (lowest..=highest).contains(&rank),
                "position {position}, token {id}: rank {rank}, the model's {lowest}..={highest}"
            );
            assert_eq!(
                entry["decoded_token"],
                tokenizer.decode(&[id], false).unwrap(),
                "position {position}"
            );
            if index > 0 {
                top_ranks.push(rank);
            }
        }
        // The alternatives are the k most likely, in order.
        let expected: Vec<usize> = (1..=k)
            .filter(|&rank| !in_top || rank != entries[&token.to_string()]["rank"])
            .collect();
        assert_eq!(top_ranks, expected, "position {position}: {entries:?}");
    }
}

/// `prompt_logprobs: k` gives each completion choice vLLM's `prompt_logprobs`, the model's, whether
/// the prompt comes as text or token ids, with `n` > 1 and beside `echo`'s own; chat answers carry them
/// once. `k` beyond 20, -1, and a streamed request asking for alternatives are refused, as vLLM refuses
/// them; without the field nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_are_the_model_s_with_true_ranks() {
    let server = start_qwen2().await;
    let client = Client::new(&server);
    let post = |path: &'static str, body: Value| client.post(path, body);
    let text = "The quick brown fox jumps over the lazy dog";
    let prompt: Vec<u32> = qwen2_tokenizer()
        .encode(text, true)
        .unwrap()
        .get_ids()
        .to_vec();
    for k in [0, 3] {
        let (status, answer) = post(
            "/v1/completions",
            json!({"prompt": text, "prompt_logprobs": k, "max_tokens": 2, "n": 2, "seed": 1}),
        )
        .await;
        assert_eq!(status, 200, "{answer:#}");
        for choice in answer["choices"].as_array().unwrap() {
            assert_prompt_logprobs(&choice["prompt_logprobs"], &prompt, k);
            assert!(choice["logprobs"].is_null());
        }
    }
    // Token ids, echoed with a different `logprobs`: each block keeps its own number of alternatives.
    let (status, answer) = post(
        "/v1/completions",
        json!({"prompt": prompt, "prompt_logprobs": 4, "echo": true, "logprobs": 1, "max_tokens": 0}),
    )
    .await;
    assert_eq!(status, 200, "{answer:#}");
    let choice = &answer["choices"][0];
    assert_prompt_logprobs(&choice["prompt_logprobs"], &prompt, 4);
    for entries in &choice["logprobs"]["top_logprobs"].as_array().unwrap()[1..] {
        let count = entries.as_object().unwrap().len();
        assert!((1..=2).contains(&count), "{entries}");
    }
    // Without the field, no `prompt_logprobs`.
    let (_, answer) = post("/v1/completions", json!({"prompt": text, "max_tokens": 1})).await;
    assert!(answer["choices"][0].get("prompt_logprobs").is_none());

    // Chat: once, beside the choices, for the rendered prompt.
    let (status, answer) = post(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": text}], "prompt_logprobs": 2,
               "max_tokens": 1, "return_token_ids": true}),
    )
    .await;
    assert_eq!(status, 200, "{answer:#}");
    let chat_prompt = ids(&answer["prompt_token_ids"]);
    assert_prompt_logprobs(&answer["prompt_logprobs"], &chat_prompt, 2);

    for (body, fragment) in [
        (
            json!({"prompt": text, "prompt_logprobs": 1, "stream": true}),
            "stream",
        ),
        (json!({"prompt": text, "prompt_logprobs": -1}), "vocabulary"),
        (json!({"prompt": text, "prompt_logprobs": 21}), "0 to 20"),
    ] {
        let (status, answer) = post("/v1/completions", body.clone()).await;
        assert_eq!(status, 400, "{body}: {answer:#}");
        let error = check_error_shape(&answer);
        assert_eq!(error["param"], "prompt_logprobs");
        assert!(
            error["message"].as_str().unwrap().contains(fragment),
            "{error:#}"
        );
    }
    // Streamed with no alternatives asked for: accepted, as vLLM accepts it (and sends none), on
    // both endpoints.
    for (path, body) in [
        ("/v1/completions", json!({"prompt": text})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": text}]}),
        ),
    ] {
        let mut body = body;
        body["prompt_logprobs"] = json!(0);
        body["stream"] = json!(true);
        body["max_tokens"] = json!(2);
        let (status, text) = client.post_text(path, body).await;
        assert_eq!(status, 200, "{text}");
        let chunks = sse_payloads(&text);
        for chunk in &chunks {
            assert!(chunk.get("prompt_logprobs").is_none(), "{chunk}");
            for choice in chunk["choices"].as_array().unwrap() {
                assert!(choice.get("prompt_logprobs").is_none(), "{chunk}");
                // A chat stream's chunks are deltas: no echoed prompt.
                assert!(
                    choice.get("text").is_none() || path == "/v1/completions",
                    "{chunk}"
                );
            }
        }
    }
}
