//! `holo serve` end to end: a tiny random model written by `holo init-model`, served by the binary, sampled
//! through the `openai` sampler, compared with the same model sampled in process.

use super::*;
#[cfg(feature = "cli")]
use common::served::{tiny_model, Served};

/// Every family's parity fixture, served by the binary: a chat completion (the model's own template) and
/// a token prompt come back as the same tokens and log-probabilities as the model sampled in process.
#[cfg(feature = "cli")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holo_serve_serves_every_family() {
    use std::process::Command;

    use holo_runtime::local::{LocalModel, LocalOptions};

    for family in common::MODEL_FAMILIES {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/models")
            .join(family);
        let served = Served::start(
            Command::new(env!("CARGO_BIN_EXE_holo"))
                .args(["serve", dir.to_str().unwrap(), "--port", "0"])
                .args(["--served-model-name", family]),
        );
        let client = OpenAi::new(OpenAiConfig {
            proxy_from_env: false,
            max_retries: 0,
            api_key_env: "HOLO_SERVE_TEST_NO_SUCH_VAR".into(),
            ..OpenAiConfig::new(&served.base, family)
        })
        .unwrap();
        let local = LocalModel::load(&dir, LocalOptions::default()).unwrap();
        let chat = vec![user("What is 2 + 2?")];
        let text = local
            .template()
            .render(&chat, &RenderOptions::generation())
            .unwrap();
        let chat_ids = local
            .tokenizer()
            .encode(text, false)
            .unwrap()
            .get_ids()
            .to_vec();
        // Past the fixtures' windows of 4 positions.
        let params = SampleParams {
            max_tokens: Some(12),
            temperature: Some(1.0),
            seed: Some(3),
            ..SampleParams::default()
        };
        for (prompt, ids) in [
            (Prompt::Chat(chat.clone()), chat_ids),
            (Prompt::Tokens(vec![5, 6, 7]), vec![5, 6, 7]),
        ] {
            let request = |prompt| Request {
                prompt,
                params: params.clone(),
            };
            let served = client.sample(&[request(prompt)]).await.pop().unwrap();
            let served = served.unwrap_or_else(|error| panic!("{family}: {error}"));
            let direct = local.sample(&[request(Prompt::Tokens(ids))]).await;
            let direct = direct.into_iter().next().unwrap().unwrap();
            assert_eq!(served.tokens, direct.tokens, "{family}");
            for (a, b) in served.logprobs.iter().zip(&direct.logprobs) {
                assert!((a - b).abs() <= 1e-5, "{family}: {served:?} vs {direct:?}");
            }
        }
    }
}

/// A gpt-oss GGUF file with MXFP4 experts, served by the binary: greedy tokens are transformers' on the
/// same weights (`gguf/gpt_oss.json`, `scripts/gguf_families.py`), and a chat through the file's own
/// template comes back as the model sampled in process.
#[cfg(feature = "cli")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holo_serve_serves_a_gpt_oss_gguf() {
    use std::process::Command;

    use holo_runtime::local::{LocalModel, LocalOptions};

    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/gguf");
    let file = fixtures.join("gpt_oss.gguf");
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("gpt_oss.json")).unwrap())
            .unwrap();
    let served = Served::start(
        Command::new(env!("CARGO_BIN_EXE_holo"))
            .args(["serve", file.to_str().unwrap(), "--port", "0"])
            .args(["--served-model-name", "gpt-oss"]),
    );
    let client = OpenAi::new(OpenAiConfig {
        proxy_from_env: false,
        max_retries: 0,
        api_key_env: "HOLO_SERVE_TEST_NO_SUCH_VAR".into(),
        ..OpenAiConfig::new(&served.base, "gpt-oss")
    })
    .unwrap();
    let greedy = &expected["greedy"];
    let tokens = ids(&greedy["tokens"]);
    let request = Request {
        prompt: Prompt::Tokens(ids(&greedy["prompt"])),
        params: SampleParams {
            max_tokens: Some(tokens.len() as u32),
            temperature: Some(0.0),
            ..SampleParams::default()
        },
    };
    let completion = client.sample(&[request]).await.pop().unwrap().unwrap();
    assert_eq!(completion.tokens, tokens);

    let local = LocalModel::load(&file, LocalOptions::default()).unwrap();
    let chat = vec![user("What is 2 + 2?")];
    let text = local
        .template()
        .render(&chat, &RenderOptions::generation())
        .unwrap();
    let chat_ids = local
        .tokenizer()
        .encode(text, false)
        .unwrap()
        .get_ids()
        .to_vec();
    let params = SampleParams {
        max_tokens: Some(8),
        temperature: Some(1.0),
        seed: Some(3),
        ..SampleParams::default()
    };
    let served = client
        .sample(&[Request {
            prompt: Prompt::Chat(chat),
            params: params.clone(),
        }])
        .await
        .pop()
        .unwrap()
        .unwrap();
    let direct = local
        .sample(&[Request {
            prompt: Prompt::Tokens(chat_ids),
            params,
        }])
        .await
        .pop()
        .unwrap()
        .unwrap();
    assert_eq!(served.tokens, direct.tokens);
    for (a, b) in served.logprobs.iter().zip(&direct.logprobs) {
        assert!((a - b).abs() <= 1e-5, "{served:?} vs {direct:?}");
    }
}

#[cfg(feature = "cli")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holo_serve_cli_serves_a_local_model() {
    use std::process::Command;

    use holo_runtime::local::{LocalModel, LocalOptions};

    let dir = tiny_model("cli");

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
    // A tool-call parser the server does not know, named with those it knows.
    let unknown_parser = Command::new(env!("CARGO_BIN_EXE_holo"))
        .args(["serve", dir.to_str().unwrap(), "--port", "0"])
        .args(["--tool-call-parser", "pythonic"])
        .output()
        .unwrap();
    assert_eq!(unknown_parser.status.code(), Some(2));
    let said = String::from_utf8_lossy(&unknown_parser.stderr);
    assert!(
        said.contains("unknown tool-call parser `pythonic`; known: hermes, llama3_json, mistral"),
        "{said}"
    );

    let served = Served::start(
        Command::new(env!("CARGO_BIN_EXE_holo"))
            .args([
                "serve",
                dir.to_str().unwrap(),
                "--port",
                "0",
                "--served-model-name",
                "tiny",
            ])
            .args(["--max-num-seqs", "4", "--max-num-batched-tokens", "64"]),
    );
    let base = served.base.clone();
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
    let requests = Client::at(base.clone());
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 3, 4], "max_tokens": 24, "seed": 4, "logprobs": 2, "stop": ["e"]}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 24,
                   "seed": 4, "logprobs": true, "top_logprobs": 3, "n": 2}),
        ),
    ] {
        let (status, whole) = requests.post(path, body.clone()).await;
        assert_eq!(status, 200, "{whole:#}");
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (status, text) = requests.post_text(path, streamed).await;
        assert_eq!(status, 200, "{text}");
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
            // The alternatives stream with their tokens (the local model reports them as it samples).
            let top = |value: &Value| -> Vec<Value> {
                let key = if chat { "content" } else { "top_logprobs" };
                value["logprobs"][key]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|entry| match chat {
                        true => json!(entry["top_logprobs"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|alt| alt["token"].clone())
                            .collect::<Vec<_>>()),
                        false => json!(entry.as_object().unwrap().keys().collect::<Vec<_>>()),
                    })
                    .collect()
            };
            assert_eq!(top(&joined), top(choice), "{text}");
            if chat {
                assert!(top(choice)
                    .iter()
                    .all(|alts| alts.as_array().unwrap().len() == 3));
            }
            assert!(
                a.iter().zip(&b).all(|(a, b)| (a - b).abs() <= 1e-5),
                "{a:?} vs {b:?}"
            );
        }
        // How many chunks there are depends on timing (the server puts the events that arrived together
        // in one chunk; the local model can sample all 24 tokens before the first is written), so only
        // their sum is checked here; streaming.rs checks that tokens stream ahead of their completion.
    }

    // One access-log line per request on stderr, with the answer's id and its usage.
    let (status, answer) = requests
        .post(
            "/v1/completions",
            json!({"prompt": [1, 2, 3], "max_tokens": 5, "n": 2, "seed": 1}),
        )
        .await;
    assert_eq!(status, 200, "{answer:#}");
    let id = answer["id"].as_str().unwrap();
    let line = served.line_with(&format!("id={id} "));
    let fields = access_fields(&line);
    assert_eq!(fields["method"], "POST", "{line}");
    assert_eq!(fields["path"], "/v1/completions", "{line}");
    assert_eq!(fields["status"], "200", "{line}");
    assert_eq!(fields["prompt_tokens"], "3", "{line}");
    assert_eq!(
        fields["completion_tokens"],
        answer["usage"]["completion_tokens"].to_string(),
        "{line}"
    );
    assert_eq!(fields["finished"], "true", "{line}");
    let queue: f64 = fields["queue_ms"].parse().unwrap();
    let total: f64 = fields["total_ms"].parse().unwrap();
    assert!(0.0 <= queue && queue <= total, "{line}");

    // /metrics: the local model's scheduler as well as the server's counters.
    let page = requests
        .http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let metrics = super::connections::parse_prometheus(&page);
    assert!(
        metrics["holo_scheduler_generated_tokens_total"] > 0.0,
        "{page}"
    );
    assert!(metrics["holo_generation_tokens_total"] > 0.0, "{page}");
    assert!(metrics["holo_request_queue_seconds_count"] > 0.0, "{page}");
    for gauge in [
        "holo_num_requests_waiting",
        "holo_num_requests_running",
        "holo_kv_cache_bytes",
        "holo_generation_tokens_per_second",
    ] {
        assert!(metrics[gauge] >= 0.0, "{gauge}: {page}");
    }
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `holo serve` with 64 file descriptors and more connections than that: accepting fails for want of
/// descriptors, the server says so and waits, the idle connections time out, and a request that came
/// after all of them is answered.
#[cfg(feature = "cli")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holo_serve_recovers_when_it_runs_out_of_file_descriptors() {
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let dir = tiny_model("nofile");
    let mut command = Command::new(env!("CARGO_BIN_EXE_holo"));
    command
        .args(["serve", dir.to_str().unwrap(), "--port", "0"])
        .args(["--keep-alive-timeout", "0.5", "--max-connections", "1000"]);
    const FILES: u64 = 64;
    // SAFETY: setrlimit is async-signal-safe, and the closure touches nothing else.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: FILES,
                rlim_max: FILES,
            };
            match libc::setrlimit(libc::RLIMIT_NOFILE, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    let served = Served::start(&mut command);
    let addr = served.base.trim_start_matches("http://").to_string();
    // More idle connections than the server has descriptors; the kernel queues those it cannot accept.
    let mut idle = Vec::new();
    for _ in 0..FILES + 16 {
        idle.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    let mut last = tokio::net::TcpStream::connect(&addr).await.unwrap();
    last.write_all(b"GET /health HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), last.read_to_end(&mut answer))
        .await
        .expect("the request after the idle connections was answered in time")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let warning = served.line_with("cannot accept connections");
    assert!(warning.contains("open_connections="), "{warning}");
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `holo serve` child (killed when dropped): where it listens, and its stderr lines as they come.
/// The `key=value` fields of an access-log line.
#[cfg(feature = "cli")]
fn access_fields(line: &str) -> std::collections::HashMap<String, String> {
    assert!(line.contains("holo::access"), "{line}");
    line.split_whitespace()
        .filter_map(|field| field.split_once('='))
        .map(|(key, value)| (key.to_string(), value.to_string()))
        .collect()
}
