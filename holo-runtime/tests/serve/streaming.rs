//! Streaming: the chunks of a streamed answer join into the whole answer to the same request.

use super::*;

impl Fixture {
    /// A streamed request: its status and its payloads.
    async fn stream(&self, path: &str, body: Value) -> (u16, Vec<Value>) {
        let response = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let content_type = response.headers()["content-type"]
            .to_str()
            .unwrap()
            .to_string();
        let text = response.text().await.unwrap();
        if status != 200 {
            return (status, vec![serde_json::from_str(&text).unwrap()]);
        }
        assert_eq!(content_type, "text/event-stream", "{text}");
        (status, sse_payloads(&text))
    }
}

/// Streams `body` and asks it whole, and checks that the chunks join into the whole answer. Returns the
/// payloads.
async fn streams_like_whole(f: &Fixture, path: &str, mut body: Value) -> Vec<Value> {
    let chat = path.ends_with("chat/completions");
    // Unseeded samples get fresh seeds, which the test sampler's logprobs show.
    if body.get("seed").is_none() {
        body["seed"] = json!(11);
    }
    let whole = f.ok(path, body.clone()).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, payloads) = f.stream(path, streamed).await;
    assert_eq!(status, 200, "{payloads:#?}");
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    for payload in &payloads {
        assert_eq!(payload["object"], object, "{payload}");
        assert_eq!(payload["id"], payloads[0]["id"], "{payload}");
        assert_eq!(payload["model"], MODEL);
        assert!(payload.get("error").is_none(), "{payload}");
    }
    let prefix = if chat { "chatcmpl-" } else { "cmpl-" };
    assert!(payloads[0]["id"].as_str().unwrap().starts_with(prefix));
    for (index, choice) in whole["choices"].as_array().unwrap().iter().enumerate() {
        let joined = join_choice(&payloads, index, chat);
        assert_eq!(
            &joined, choice,
            "{body}: choice {index}, streamed {payloads:#?}"
        );
    }
    if chat && body["return_token_ids"] == true {
        assert_eq!(payloads[0]["prompt_token_ids"], whole["prompt_token_ids"]);
    }
    payloads
}

const STREAMED_COMPLETIONS: &[&str] = &[
    r#"{"prompt": "Hello world, héllo wörld 日本語", "max_tokens": 40, "logprobs": 1, "seed": 3}"#,
    r#"{"prompt": "Hello world, héllo wörld 日本語", "max_tokens": 40, "stop": [" wö", "zz"], "logprobs": 0}"#,
    r#"{"prompt": "Hello world, héllo wörld 日本語", "max_tokens": 40, "stop": "llo w", "include_stop_str_in_output": true}"#,
    r#"{"prompt": "Hello world, héllo wörld 日本語", "max_tokens": 40, "stop": ["日本"]}"#,
    r#"{"prompt": ["abc def", "ghi jkl"], "n": 2, "max_tokens": 3, "seed": 5, "logprobs": 2, "return_token_ids": true}"#,
    r#"{"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "stop": ["zz"], "return_tokens_as_token_ids": true, "logprobs": 1}"#,
];

const STREAMED_CHATS: &[&str] = &[
    r#"{"messages": [{"role": "user", "content": "Héllo 日本"}], "max_tokens": 12, "logprobs": true, "seed": 2}"#,
    r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}], "stop": ["brief"], "n": 3, "return_token_ids": true}"#,
    r#"{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1}"#,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_answers_join_into_the_whole_answers() {
    // A sampler that reports nothing early (every token comes with the completion), and one that reports
    // each token as it samples it.
    for echo in [
        Echo::new(Duration::ZERO),
        Echo::streaming(Duration::from_millis(3)),
    ] {
        let streams = echo.streams;
        let f = start_echo(echo, ServeConfig::default(), None).await;
        for body in STREAMED_COMPLETIONS {
            let body: Value = serde_json::from_str(body).unwrap();
            let payloads = streams_like_whole(&f, "/v1/completions", body.clone()).await;
            if streams && body["max_tokens"] == 40 {
                // Tokens arrived before the completion (events that arrive together share a chunk).
                assert!(payloads.len() > 1, "{body}: {payloads:#?}");
            }
        }
        for body in STREAMED_CHATS {
            let body: Value = serde_json::from_str(body).unwrap();
            streams_like_whole(&f, "/v1/chat/completions", body).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_usage() {
    let f = start_echo(
        Echo::streaming(Duration::ZERO),
        ServeConfig::default(),
        None,
    )
    .await;
    let body = json!({"prompt": ["Hello world", "abc"], "n": 2, "max_tokens": 5, "seed": 1});
    let whole = f.ok("/v1/completions", body.clone()).await;

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, payloads) = f.stream("/v1/completions", streamed.clone()).await;
    assert!(payloads
        .iter()
        .all(|payload| payload.get("usage").is_none()));

    streamed["stream_options"] = json!({"include_usage": true});
    let (_, payloads) = f.stream("/v1/completions", streamed.clone()).await;
    let (last, chunks) = payloads.split_last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], whole["usage"]);
    assert!(chunks.iter().all(|chunk| chunk["usage"].is_null()));

    streamed["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    let (_, payloads) = f.stream("/v1/completions", streamed).await;
    let (last, chunks) = payloads.split_last().unwrap();
    assert_eq!(last["usage"], whole["usage"]);
    for chunk in chunks {
        let choice = &chunk["choices"][0];
        let prompt = if choice["index"].as_u64().unwrap() < 2 {
            "Hello world"
        } else {
            "abc"
        };
        assert_eq!(
            chunk["usage"]["prompt_tokens"],
            encode(prompt).len(),
            "{chunk}"
        );
        let sofar = chunk["usage"]["completion_tokens"].as_u64().unwrap();
        assert!((1..=5).contains(&sofar), "{chunk}");
    }

    let chat = json!({
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": true,
        "stream_options": {"include_usage": true},
    });
    let (_, payloads) = f.stream("/v1/chat/completions", chat.clone()).await;
    let mut whole_chat = chat.clone();
    whole_chat["stream"] = json!(false);
    whole_chat.as_object_mut().unwrap().remove("stream_options");
    let whole = f.ok("/v1/chat/completions", whole_chat).await;
    assert_eq!(payloads.last().unwrap()["usage"], whole["usage"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_errors() {
    let f = start_echo(
        Echo::streaming(Duration::ZERO),
        ServeConfig::default(),
        None,
    )
    .await;
    // Whatever is wrong with the request is a plain error response, before any event.
    let (status, payloads) = f
        .stream("/v1/completions", json!({"prompt": "", "stream": true}))
        .await;
    assert_eq!(status, 400);
    check_error_shape(&payloads[0]);
    // A sampler failure after the stream has started is its last event.
    for (prompt, code) in [
        ("UNAVAILABLE", "sampler_unavailable"),
        ("MALFORMED", "sampler_error"),
        ("PANIC", "sampler_error"),
    ] {
        let (status, payloads) = f
            .stream("/v1/completions", json!({"prompt": prompt, "stream": true}))
            .await;
        assert_eq!(status, 200);
        let error = check_error_shape(payloads.last().unwrap());
        assert_eq!(error["code"], code, "{payloads:#?}");
    }
    // The server goes on.
    streams_like_whole(
        &f,
        "/v1/completions",
        json!({"prompt": "fine", "max_tokens": 3}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_and_whole_requests_run_side_by_side() {
    let f = start_echo(
        Echo::streaming(Duration::from_millis(1)),
        ServeConfig::default(),
        None,
    )
    .await;
    let body = |i: usize| {
        json!({"prompt": format!("request number {i} é"), "seed": i, "max_tokens": 12, "logprobs": 1,
               "n": 1 + i % 2})
    };
    let streamed = (0..4).map(|i| {
        let mut request = body(i);
        request["stream"] = json!(true);
        f.stream("/v1/completions", request)
    });
    let whole = (0..4).map(|i| f.post("/v1/completions", body(i)));
    let (streamed, whole) = tokio::join!(futures_join_all(streamed), futures_join_all(whole));
    for (i, ((status, payloads), (whole_status, answer))) in streamed.iter().zip(&whole).enumerate()
    {
        assert_eq!((*status, *whole_status), (200, 200));
        let choices = answer["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 1 + i % 2);
        for (index, choice) in choices.iter().enumerate() {
            assert_eq!(&join_choice(payloads, index, false), choice, "request {i}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_stops_its_sample() {
    let f = start_echo(
        Echo::streaming(Duration::from_millis(40)),
        ServeConfig::default(),
        None,
    )
    .await;
    let prompt = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen";
    assert!(encode(prompt).len() >= 20);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 30, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 30, "stream": true}),
        ),
        // Not streamed: the client gives up waiting.
        (
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 30}),
        ),
    ] {
        let before = f.echo.cancelled.load(Ordering::SeqCst);
        let request = f
            .client
            .post(format!("{}{path}", f.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send();
        if body["stream"] == true {
            // Two events, so that the sampler has begun (a chat answer's first is the role's).
            let mut response = request.await.unwrap();
            assert_eq!(response.status(), 200);
            let mut read = String::new();
            while read.matches("data:").count() < 2 {
                let chunk = response.chunk().await.unwrap().expect("more events");
                read.push_str(&String::from_utf8_lossy(&chunk));
            }
            drop(response);
        } else {
            assert!(tokio::time::timeout(Duration::from_millis(200), request)
                .await
                .is_err());
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while f.echo.cancelled.load(Ordering::SeqCst) == before {
            assert!(
                std::time::Instant::now() < deadline,
                "{path} {body}: the sampler was never told"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
