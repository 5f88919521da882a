//! `holo serve` end to end: a tiny random model written by `holo init-model`, served by the binary, sampled
//! through the `openai` sampler, compared with the same model sampled in process.

use super::*;

/// The `holo serve` child process; killed when dropped.
#[cfg(feature = "cli")]
struct Child(std::process::Child);

#[cfg(feature = "cli")]
impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[cfg(feature = "cli")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holo_serve_cli_serves_a_local_model() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    use holo_runtime::local::{LocalModel, LocalOptions};

    let dir = std::env::temp_dir().join(format!("holo-serve-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let init = Command::new(env!("CARGO_BIN_EXE_holo"))
        .args(["init-model", "--preset", "tiny", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        init.status.success(),
        "holo init-model failed:\n{}",
        String::from_utf8_lossy(&init.stderr)
    );

    // Usage errors first: a folder that is not a model.
    let missing = Command::new(env!("CARGO_BIN_EXE_holo"))
        .args([
            "serve",
            dir.join("nothing").to_str().unwrap(),
            "--port",
            "0",
        ])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("error:"));

    let mut child = Child(
        Command::new(env!("CARGO_BIN_EXE_holo"))
            .args([
                "serve",
                dir.to_str().unwrap(),
                "--port",
                "0",
                "--served-model-name",
                "tiny",
            ])
            .args(["--max-num-seqs", "4", "--max-num-batched-tokens", "64"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stderr = child.0.stderr.take().unwrap();
    let base = tokio::task::spawn_blocking(move || {
        let mut seen = String::new();
        for line in std::io::BufReader::new(stderr).lines() {
            let line = line.unwrap();
            if let Some(at) = line.find("http://") {
                let url = line[at..].split_whitespace().next().unwrap().to_string();
                return url;
            }
            seen.push_str(&line);
            seen.push('\n');
        }
        panic!("holo serve ended without saying where it listens:\n{seen}");
    })
    .await
    .unwrap();

    let client = OpenAi::new(OpenAiConfig {
        proxy_from_env: false,
        max_retries: 0,
        api_key_env: "HOLO_SERVE_TEST_NO_SUCH_VAR".into(),
        ..OpenAiConfig::new(&base, "tiny")
    })
    .unwrap();
    let local = LocalModel::load(&dir, LocalOptions::default()).unwrap();
    let chat = vec![user("What is 2 + 2?")];
    let chat_ids = {
        let text = local
            .template()
            .render(&chat, &RenderOptions::generation())
            .unwrap();
        local
            .tokenizer()
            .encode(text, false)
            .unwrap()
            .get_ids()
            .to_vec()
    };
    let params = SampleParams {
        max_tokens: Some(6),
        temperature: Some(1.0),
        seed: Some(9),
        ..SampleParams::default()
    };
    // One request at a time, so that the server's batches are the in-process ones (a batch of 1).
    for (prompt, ids) in [
        (Prompt::Chat(chat.clone()), chat_ids.clone()),
        (Prompt::Tokens(vec![1, 2, 3, 4]), vec![1, 2, 3, 4]),
    ] {
        let served = client
            .sample(&[Request {
                prompt,
                params: params.clone(),
            }])
            .await
            .pop()
            .unwrap()
            .unwrap();
        let direct = local
            .sample(&[Request {
                prompt: Prompt::Tokens(ids),
                params: params.clone(),
            }])
            .await
            .pop()
            .unwrap()
            .unwrap();
        assert_eq!(served.tokens, direct.tokens);
        assert_eq!(served.text, direct.text);
        assert_eq!(served.finish, direct.finish);
        assert_eq!(served.logprobs.len(), direct.logprobs.len());
        for (a, b) in served.logprobs.iter().zip(&direct.logprobs) {
            assert!((a - b).abs() <= 1e-5, "{served:?} vs {direct:?}");
        }
    }

    // Streamed: the local model reports each token as it samples it, and the chunks join into the whole
    // answer to the same request.
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 3, 4], "max_tokens": 24, "seed": 4, "logprobs": 1, "stop": ["e"]}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 24,
                   "seed": 4, "logprobs": true, "n": 2}),
        ),
    ] {
        let url = format!("{base}{path}");
        let whole: Value = http
            .post(&url)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap()
            .text()
            .await
            .map(|text| serde_json::from_str(&text).unwrap())
            .unwrap();
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let text = http
            .post(&url)
            .header("content-type", "application/json")
            .body(streamed.to_string())
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let payloads = sse_payloads(&text);
        let chat = path.ends_with("chat/completions");
        for (index, choice) in whole["choices"].as_array().unwrap().iter().enumerate() {
            let joined = join_choice(&payloads, index, chat);
            assert_eq!(joined["finish_reason"], choice["finish_reason"], "{text}");
            let key = if chat { "message" } else { "text" };
            assert_eq!(joined[key], choice[key], "{text}");
            let lp = |value: &Value| -> Vec<f32> {
                let entries = if chat {
                    value["logprobs"]["content"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|entry| entry["logprob"].clone())
                        .collect::<Vec<_>>()
                } else {
                    value["logprobs"]["token_logprobs"]
                        .as_array()
                        .unwrap()
                        .clone()
                };
                entries
                    .iter()
                    .map(|lp| lp.as_f64().unwrap() as f32)
                    .collect()
            };
            let (a, b) = (lp(&joined), lp(choice));
            assert_eq!(a.len(), b.len(), "{text}");
            assert!(
                a.iter().zip(&b).all(|(a, b)| (a - b).abs() <= 1e-5),
                "{a:?} vs {b:?}"
            );
        }
        // Tokens arrived before the completions: more chunks than chat's role chunks and each choice's
        // last one.
        let choices = whole["choices"].as_array().unwrap().len();
        let roles = if chat { choices } else { 0 };
        assert!(payloads.len() > roles + choices, "{text}");
    }
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
}
