//! `echo` with prompt log-probabilities, and `n` over one prefill, on the local model (the tiny Qwen2 of
//! `tests/fixtures/models/qwen2`): what the server reports for every prompt token is the model's own
//! log-softmax over the whole sequence, computed here without the server.

use super::*;
use crate::common::logits::sequence_logits;
use holo_runtime::local::{Limits, LocalModel, LocalOptions};

/// The fixture's folder.
pub(super) fn qwen2_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen2")
}

/// The tiny Qwen2 served in process under [`MODEL`].
pub(super) async fn start_qwen2() -> ServerHandle {
    start_qwen2_with(Limits::default()).await
}

/// [`start_qwen2`] with the scheduler's `limits`.
async fn start_qwen2_with(limits: Limits) -> ServerHandle {
    let options = LocalOptions {
        limits,
        ..LocalOptions::default()
    };
    let model = LocalModel::load(qwen2_dir(), options).unwrap();
    Server::bind(
        "127.0.0.1:0",
        ServedModel::local(MODEL, model),
        ServeConfig::default(),
    )
    .await
    .unwrap()
    .spawn()
}

impl Client {
    /// A completions request that must succeed.
    async fn complete(&self, body: Value) -> Value {
        let (status, answer) = self.post("/v1/completions", body).await;
        assert_eq!(status, 200, "{answer:#}");
        answer
    }

    /// `holo_scheduler_prefilled_tokens_total` now.
    async fn prefilled(&self) -> u64 {
        let page = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        page.lines()
            .find_map(|line| line.strip_prefix("holo_scheduler_prefilled_tokens_total "))
            .unwrap_or_else(|| panic!("no prefill counter in\n{page}"))
            .parse()
            .unwrap()
    }
}

/// Log-softmax of one row of logits, in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    logits.iter().map(|&x| x as f64 - max - sum.ln()).collect()
}

/// The model's log-probability of every token of `sequence` after the first, given the tokens before
/// it, and the most likely token's at each of those positions.
fn reference(sequence: &[u32]) -> (Vec<f64>, Vec<f64>) {
    let model = LocalModel::load(qwen2_dir(), LocalOptions::default()).unwrap();
    let logits = sequence_logits(model.model(), sequence);
    let mut logprobs = Vec::new();
    let mut best = Vec::new();
    for (position, row) in logits.iter().enumerate().take(sequence.len() - 1) {
        let row = log_softmax(row);
        logprobs.push(row[sequence[position + 1] as usize]);
        best.push(row.iter().copied().fold(f64::NEG_INFINITY, f64::max));
    }
    (logprobs, best)
}

/// Asserts that a choice's echoed `logprobs` are the model's for `sequence` (the prompt, then what the
/// choice sampled): `null` first, then each token's log-probability within 1e-4 of the reference, its
/// position's entries the token and the `k` most likely, and offsets that run on across the whole text.
fn assert_scored(choice: &Value, sequence: &[u32], k: usize) {
    let logprobs = &choice["logprobs"];
    let tokens = logprobs["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), sequence.len(), "{choice:#}");
    let token_logprobs = logprobs["token_logprobs"].as_array().unwrap();
    let top_logprobs = logprobs["top_logprobs"].as_array().unwrap();
    assert!(token_logprobs[0].is_null() && top_logprobs[0].is_null());
    let (expected, best) = reference(sequence);
    for position in 1..sequence.len() {
        let got = token_logprobs[position].as_f64().unwrap();
        let want = expected[position - 1];
        assert!(
            (got - want).abs() < 1e-4,
            "token {position}: {got} against the model's {want}"
        );
        let entries = top_logprobs[position].as_object().unwrap();
        let name = tokens[position].as_str().unwrap();
        assert_eq!(entries[name].as_f64(), Some(got), "position {position}");
        assert!(entries.len() <= k + 1 && entries.len() >= k, "{entries:?}");
        // The most likely entry is the reference's most likely token (by log-probability: two
        // tokens may spell the same name).
        let entry_best = entries
            .values()
            .map(|lp| lp.as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        if k > 0 {
            assert!(
                (entry_best - best[position - 1]).abs() < 1e-4,
                "position {position}"
            );
        }
    }
    let offsets = logprobs["text_offset"].as_array().unwrap();
    let text = choice["text"].as_str().unwrap();
    assert_eq!(offsets[0], 0);
    assert!(offsets
        .windows(2)
        .all(|pair| pair[0].as_u64() <= pair[1].as_u64()));
    assert!(offsets.last().unwrap().as_u64().unwrap() as usize <= text.chars().count());
}

/// `echo` with `logprobs` and `max_tokens: 0` scores the prompt as the model does, whether it comes as
/// text, as token ids, or as a batch of either; with `max_tokens` > 0 the choice goes on with what it
/// sampled, scored as the completion's own logprobs are. The same when the prompts are prefilled a
/// few tokens a step (`max_num_batched_tokens` 5: one or two columns per prompt and step).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_reports_the_model_s_prompt_log_probabilities() {
    let chunked = Limits {
        max_num_batched_tokens: 5,
        ..Limits::default()
    };
    for limits in [Limits::default(), chunked] {
        echo_scores_prompts(start_qwen2_with(limits).await).await;
    }
}

async fn echo_scores_prompts(server: ServerHandle) {
    let client = Client::new(&server);
    let text = "The quick brown fox jumps over the lazy dog";
    let scored = client
        .complete(json!({"prompt": text, "echo": true, "logprobs": 3, "max_tokens": 0}))
        .await;
    let choice = &scored["choices"][0];
    assert_eq!(choice["text"], text);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(scored["usage"]["completion_tokens"], 0);
    let prompt: Vec<u32> = tokenizer_ids(text);
    assert_eq!(scored["usage"]["prompt_tokens"], prompt.len());
    assert_scored(choice, &prompt, 3);
    let names: Vec<String> = choice["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|name| name.as_str().unwrap().to_string())
        .collect();
    assert_eq!(names.concat(), text, "the tokens spell the prompt");

    // The same prompt as token ids, twice in one batch beside a shorter one: each scored alone.
    let shorter = &prompt[..5];
    let batch = client
        .complete(
            json!({"prompt": [prompt, shorter, prompt], "echo": true, "logprobs": 1,
                         "max_tokens": 0}),
        )
        .await;
    let choices = batch["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    assert_eq!(choices[0]["text"], text);
    for (choice, ids) in choices.iter().zip([&prompt[..], shorter, &prompt[..]]) {
        assert_scored(choice, ids, 1);
    }
    assert_eq!(
        choices[0]["logprobs"]["token_logprobs"],
        choices[2]["logprobs"]["token_logprobs"]
    );

    // lm-evaluation-harness' request: one greedy token after the echoed prompt.
    let generated = client
        .complete(
            json!({"prompt": [text, "Hello"], "echo": true, "logprobs": 2, "max_tokens": 3,
                         "temperature": 0, "ignore_eos": true, "return_token_ids": true}),
        )
        .await;
    for (choice, prompt_text) in generated["choices"]
        .as_array()
        .unwrap()
        .iter()
        .zip([text, "Hello"])
    {
        let sampled = ids(&choice["token_ids"]);
        assert_eq!(sampled.len(), 3, "{choice:#}");
        let mut sequence = tokenizer_ids(prompt_text);
        sequence.extend(&sampled);
        assert_scored(choice, &sequence, 2);
        let completion_text = qwen2_tokenizer().decode(&sampled, true).unwrap();
        assert_eq!(choice["text"], format!("{prompt_text}{completion_text}"));
    }

    // Without `logprobs`, `echo` only prepends the prompt.
    let plain = client
        .complete(json!({"prompt": [[5, 6, 7]], "echo": true, "max_tokens": 2, "temperature": 0}))
        .await;
    let choice = &plain["choices"][0];
    assert!(choice["logprobs"].is_null());
    let prompt_text = qwen2_tokenizer().decode(&[5, 6, 7], false).unwrap();
    assert!(
        choice["text"].as_str().unwrap().starts_with(&prompt_text),
        "{choice:#}"
    );
    server.shutdown().await.unwrap();
}

fn qwen2_tokenizer() -> Tokenizer {
    Tokenizer::from_file(qwen2_dir().join("tokenizer.json")).unwrap()
}

/// The fixture's token ids of `text` (no special tokens are added: Qwen2 has no BOS).
fn tokenizer_ids(text: &str) -> Vec<u32> {
    qwen2_tokenizer()
        .encode(text, true)
        .unwrap()
        .get_ids()
        .to_vec()
}

/// The `n` samples of a prompt share one prefill, scored or not: the model runs the prompt's tokens
/// once, as the scheduler's counter of prefilled tokens shows, and every scored choice reports the same
/// prompt log-probabilities. A prompt the prefix cache holds is not run again unless it is scored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_samples_share_one_prefill() {
    let server = start_qwen2().await;
    let client = Client::new(&server);
    let prompt = tokenizer_ids("Once upon a time, in a land far away");
    let length = prompt.len() as u64;

    let before = client.prefilled().await;
    let sampled = client
        .complete(json!({"prompt": prompt, "n": 4, "max_tokens": 4, "seed": 7}))
        .await;
    assert_eq!(sampled["choices"].as_array().unwrap().len(), 4);
    let once = client.prefilled().await - before;
    assert_eq!(once, length, "4 samples of a {length}-token prompt");

    // The same prompt again: the prefix cache holds it, so at most its last token runs.
    let before = client.prefilled().await;
    client
        .complete(json!({"prompt": prompt, "n": 4, "max_tokens": 4, "seed": 8}))
        .await;
    let again = client.prefilled().await - before;
    assert!(again < length, "{again} tokens run for a cached prompt");

    // Scored: the prompt runs whole, once for the 4 choices, which all report its log-probabilities.
    let before = client.prefilled().await;
    let scored = client
        .complete(
            json!({"prompt": prompt, "n": 4, "max_tokens": 2, "echo": true, "logprobs": 0,
                         "seed": 9}),
        )
        .await;
    assert_eq!(client.prefilled().await - before, length);
    let choices = scored["choices"].as_array().unwrap();
    let prompt_part = |choice: &Value| {
        choice["logprobs"]["token_logprobs"].as_array().unwrap()[..prompt.len()].to_vec()
    };
    assert!(choices
        .iter()
        .all(|choice| prompt_part(choice) == prompt_part(&choices[0])));
    let (expected, _) = reference(&prompt);
    for (got, want) in prompt_part(&choices[0])[1..].iter().zip(&expected) {
        assert!((got.as_f64().unwrap() - want).abs() < 1e-4);
    }
    server.shutdown().await.unwrap();
}

/// Streamed, a choice that echoes its prompt opens with it (its log-probabilities too when asked), and
/// its chunks joined are the choice not streamed: text, tokens, log-probabilities and offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_echo_joins_to_the_answer_not_streamed() {
    let server = start_qwen2().await;
    let client = Client::new(&server);
    for logprobs in [json!(2), Value::Null] {
        for max_tokens in [0, 3] {
            let body = json!({"prompt": ["The quick brown fox", "Hello"], "echo": true, "n": 2,
                              "logprobs": logprobs, "max_tokens": max_tokens, "temperature": 0,
                              "ignore_eos": true});
            let whole = client.complete(body.clone()).await;
            let mut streamed = body;
            streamed["stream"] = json!(true);
            let (status, text) = client.post_text("/v1/completions", streamed).await;
            assert_eq!(status, 200, "{text}");
            let chunks = sse_payloads(&text);
            for (index, choice) in whole["choices"].as_array().unwrap().iter().enumerate() {
                let joined = join_choice(&chunks, index, false);
                assert_eq!(joined["text"], choice["text"], "{logprobs} {max_tokens}");
                assert_eq!(
                    joined["logprobs"], choice["logprobs"],
                    "{logprobs} {max_tokens}"
                );
                assert_eq!(joined["finish_reason"], choice["finish_reason"]);
            }
        }
    }
    server.shutdown().await.unwrap();
}

/// What `echo` cannot do is a 400 naming it: on chat, and `max_tokens: 0` without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_refuses_what_it_cannot_do() {
    let server = start_qwen2().await;
    let client = Client::new(&server);
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "echo": true}),
            "echo",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}),
            "max_tokens",
        ),
    ] {
        let (status, answer) = client.post(path, body.clone()).await;
        assert_eq!(status, 400, "{body}: {answer:#}");
        assert_eq!(answer["error"]["param"], param, "{body}: {answer:#}");
    }
    server.shutdown().await.unwrap();
}
