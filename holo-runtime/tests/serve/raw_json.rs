//! Raw JSON for every field and error.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_routes() {
    let f = start().await;
    let (status, health) = f.get("/health").await;
    assert_eq!((status, health), (200, json!({"status": "ok"})));

    let (status, models) = f.get("/v1/models").await;
    assert_eq!(status, 200);
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"].as_array().unwrap().len(), 1);
    let model = &models["data"][0];
    assert_eq!(model["id"], MODEL);
    assert_eq!(model["object"], "model");
    assert!(model["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(model["owned_by"], "holo");

    let (status, one) = f.get(&format!("/v1/models/{MODEL}")).await;
    assert_eq!((status, &one), (200, model));
    let (status, missing) = f.get("/v1/models/other").await;
    assert_eq!(status, 404);
    assert_eq!(check_error_shape(&missing)["code"], "model_not_found");

    let (status, unknown) = f.get("/v2/everything").await;
    assert_eq!(status, 404);
    let error = check_error_shape(&unknown);
    assert_eq!(error["code"], "not_found");
    assert!(error["message"]
        .as_str()
        .unwrap()
        .contains("/v2/everything"));

    let (status, wrong) = f.get("/v1/completions").await;
    assert_eq!(status, 405);
    assert_eq!(check_error_shape(&wrong)["code"], "method_not_allowed");
    f.server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_text_prompt() {
    let f = start().await;
    let answer = f
        .ok(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Hello world", "max_tokens": 50, "temperature": 0.5,
                   "top_p": 0.9, "top_k": 40, "seed": 11}),
        )
        .await;
    let prompt = encode("Hello world");
    assert!(prompt.len() <= WINDOW);
    assert_eq!(answer["object"], "text_completion");
    assert!(answer["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(answer["model"], MODEL);
    assert!(answer["created"].as_u64().is_some());
    let choices = answer["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 1);
    assert_eq!(choices[0]["index"], 0);
    assert_eq!(choices[0]["text"], "Hello world");
    assert_eq!(choices[0]["finish_reason"], "stop");
    assert_eq!(choices[0]["stop_reason"], Value::Null);
    assert_eq!(choices[0]["logprobs"], Value::Null);
    assert_eq!(
        answer["usage"],
        json!({"prompt_tokens": prompt.len(), "completion_tokens": prompt.len(),
               "total_tokens": 2 * prompt.len()})
    );
    // What reached the sampler: the tokens, and every parameter.
    let requests = f.echo.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].prompt, Prompt::Tokens(prompt));
    assert_eq!(
        requests[0].params,
        SampleParams {
            max_tokens: Some(50),
            temperature: Some(0.5),
            top_p: Some(0.9),
            top_k: Some(40),
            stop: vec![],
            seed: Some(11),
            top_logprobs: 0,
            ..SampleParams::default()
        }
    );
    // Defaults: max_tokens 16 (OpenAI's), top_k -1 and 0 turn top-k off, an unseeded request still gets
    // a seed (from the server's generator).
    f.echo.clear();
    for top_k in [-1, 0] {
        f.ok(
            "/v1/completions",
            json!({"prompt": "Hi", "top_k": top_k, "temperature": null}),
        )
        .await;
    }
    for request in f.echo.requests() {
        assert_eq!(request.params.max_tokens, Some(16));
        assert_eq!(request.params.top_k, None);
        assert_eq!(request.params.temperature, None);
        assert!(request.params.seed.is_some());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_prompt_shapes_n_and_seeds() {
    let f = start().await;
    let (a, b) = (encode("one two"), encode("three"));
    let shapes = [json!(["one two", "three"]), json!([a.clone(), b.clone()])];
    for prompt in shapes {
        f.echo.clear();
        let answer = f
            .ok(
                "/v1/completions",
                json!({"prompt": prompt, "n": 2, "seed": 7, "return_token_ids": true}),
            )
            .await;
        let choices = answer["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 4);
        // Prompt-major: prompt p, sample j is choice p * n + j.
        for (index, choice) in choices.iter().enumerate() {
            assert_eq!(choice["index"], index);
            let prompt = if index < 2 { &a } else { &b };
            assert_eq!(ids(&choice["prompt_token_ids"]), *prompt);
            assert_eq!(ids(&choice["token_ids"]), *prompt);
        }
        assert_eq!(answer["usage"]["prompt_tokens"], a.len() + b.len());
        assert_eq!(
            answer["usage"]["completion_tokens"],
            2 * (a.len() + b.len())
        );
        // All four in one batch; sample 0 of each prompt uses the seed itself, sample 1 a derived one,
        // the same for every prompt.
        let batches = f.echo.batches();
        assert_eq!(batches.len(), 1, "one request's samples form one batch");
        let seeds: Vec<u64> = batches[0].iter().map(|r| r.params.seed.unwrap()).collect();
        assert_eq!(seeds[0], 7);
        assert_eq!(seeds[2], 7);
        assert_ne!(seeds[1], 7);
        assert_eq!(seeds[1], seeds[3]);
        assert!(seeds[1] <= i64::MAX as u64);
    }
    // A single token-id list is one prompt; the same seed gives the same derived seeds again.
    f.echo.clear();
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": a.clone(), "n": 3, "seed": 7}),
        )
        .await;
    assert_eq!(answer["choices"].as_array().unwrap().len(), 3);
    let seeds: Vec<u64> = f
        .echo
        .requests()
        .iter()
        .map(|r| r.params.seed.unwrap())
        .collect();
    assert_eq!(seeds.len(), 3);
    f.echo.clear();
    f.ok(
        "/v1/completions",
        json!({"prompt": a.clone(), "n": 3, "seed": 7}),
    )
    .await;
    let again: Vec<u64> = f
        .echo
        .requests()
        .iter()
        .map(|r| r.params.seed.unwrap())
        .collect();
    assert_eq!(seeds, again);
    // Without a seed the n samples still get distinct seeds.
    f.echo.clear();
    f.ok("/v1/completions", json!({"prompt": a, "n": 4})).await;
    let mut unseeded: Vec<u64> = f
        .echo
        .requests()
        .iter()
        .map(|r| r.params.seed.unwrap())
        .collect();
    unseeded.sort_unstable();
    unseeded.dedup();
    assert_eq!(unseeded.len(), 4);
    // A negative seed is read as its two's complement.
    f.echo.clear();
    f.ok("/v1/completions", json!({"prompt": "x", "seed": -1}))
        .await;
    assert_eq!(f.echo.requests()[0].params.seed, Some(u64::MAX));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_max_tokens_and_stop() {
    let f = start().await;
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": "Hello world and more", "max_tokens": 2}),
        )
        .await;
    let prompt = encode("Hello world and more");
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["stop_reason"], Value::Null);
    assert_eq!(
        choice["text"],
        tokenizer().decode(&prompt[..2], false).unwrap()
    );
    assert_eq!(answer["usage"]["completion_tokens"], 2);

    // A stop string ends the text before it (OpenAI), and is named in stop_reason (vLLM).
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": "Hello world and more", "stop": " and"}),
        )
        .await;
    let choice = &answer["choices"][0];
    assert_eq!(choice["text"], "Hello world");
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["stop_reason"], " and");
    // The first stop that matches, in a list; include_stop_str_in_output keeps it.
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": "Hello world and more", "stop": ["more", "wor"],
                   "include_stop_str_in_output": true}),
        )
        .await;
    let choice = &answer["choices"][0];
    assert_eq!(choice["text"], "Hello wor");
    assert_eq!(choice["stop_reason"], "wor");
    let requests = f.echo.requests();
    assert_eq!(requests.last().unwrap().params.stop, ["more", "wor"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_logprobs() {
    let f = start().await;
    let text = "Hé, 日本 ok";
    let prompt = encode(text);
    assert!(prompt.len() <= WINDOW);
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": text, "logprobs": 2, "seed": 2}),
        )
        .await;
    let choice = &answer["choices"][0];
    assert_eq!(choice["text"], text);
    let logprobs = &choice["logprobs"];
    let expected: Vec<f32> = (0..prompt.len())
        .map(|i| -0.25 * (i as f32 + 1.0) - 0.125)
        .collect();
    assert_eq!(floats(&logprobs["token_logprobs"]), expected);
    // Per position the sampled token and the other most likely one, as vLLM writes them: `{token: logprob}`.
    let top = logprobs["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), prompt.len());
    for (i, (position, &lp)) in top.iter().zip(&expected).enumerate() {
        let sampled = logprobs["tokens"][i].as_str().unwrap();
        assert_eq!(position[sampled].as_f64().unwrap() as f32, lp, "{position}");
        let mut values = floats(&Value::Array(
            position.as_object().unwrap().values().cloned().collect(),
        ));
        values.sort_by(|a, b| b.total_cmp(a));
        assert_eq!(values, [lp, lp - 1.0], "{position}");
    }
    // Asked for none, the sampled token alone.
    let zero = f
        .ok(
            "/v1/completions",
            json!({"prompt": text, "logprobs": 0, "seed": 2, "max_tokens": 2}),
        )
        .await;
    let zero = &zero["choices"][0]["logprobs"];
    assert_eq!(
        zero["top_logprobs"],
        json!([{zero["tokens"][0].as_str().unwrap(): -0.375}, {zero["tokens"][1].as_str().unwrap(): -0.625}])
    );
    // Each token's text, and where it starts in the choice's text (in characters).
    let tokens: Vec<String> = logprobs["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    assert_eq!(tokens.len(), prompt.len());
    let offsets: Vec<usize> = logprobs["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    let chars: Vec<char> = text.chars().collect();
    for (token, &offset) in tokens.iter().zip(&offsets) {
        if !token.contains('\u{FFFD}') {
            let at: String = chars[offset..offset + token.chars().count()]
                .iter()
                .collect();
            assert_eq!(&at, token, "offset {offset} in {text:?}");
        }
    }
    // return_tokens_as_token_ids (vLLM).
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": text, "logprobs": 0, "return_tokens_as_token_ids": true}),
        )
        .await;
    let tokens: Vec<String> = prompt.iter().map(|id| format!("token_id:{id}")).collect();
    assert_eq!(answer["choices"][0]["logprobs"]["tokens"], json!(tokens));
    assert_eq!(
        answer["choices"][0]["logprobs"]["text_offset"],
        json!(offsets)
    );
}

/// `echo` prepends each prompt to its choices' text, whatever sampler answers; with `logprobs` it needs
/// the prompt's log-probabilities, which a sampler that cannot score a prompt (this one) refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_echo() {
    let f = start().await;
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": ["Hé, 日本", "ok"], "echo": true, "n": 2, "max_tokens": 1}),
        )
        .await;
    let texts: Vec<&str> = answer["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|choice| choice["text"].as_str().unwrap())
        .collect();
    let first = |text: &str| tokenizer().decode(&encode(text)[..1], false).unwrap();
    let echoed = |text: &str| format!("{text}{}", first(text));
    assert_eq!(
        texts,
        [
            echoed("Hé, 日本").as_str(),
            &echoed("Hé, 日本"),
            &echoed("ok"),
            &echoed("ok")
        ]
    );
    // Token ids echo as their tokens' text.
    let ids = encode("ok");
    let answer = f
        .ok(
            "/v1/completions",
            json!({"prompt": ids, "echo": true, "max_tokens": 0}),
        )
        .await;
    assert_eq!(answer["choices"][0]["text"], "ok");
    assert_eq!(answer["usage"]["completion_tokens"], 0);
    let error = f
        .fails(
            "/v1/completions",
            json!({"prompt": "x", "echo": true, "logprobs": 1}),
            400,
        )
        .await;
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|message| message.contains("prompt_logprobs")),
        "{error:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions() {
    let f = start().await;
    let answer = f
        .ok(
            "/v1/chat/completions",
            json!({
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                ],
                "logprobs": true,
                "top_logprobs": 3,
                "n": 2,
                "seed": 5,
                "max_tokens": 100,
                "max_completion_tokens": 6,
                "temperature": 0.7,
                "top_p": 0.95,
                "stop": ["never"],
                "return_token_ids": true,
            }),
        )
        .await;
    let messages = [
        ChatMessage {
            role: Role::System,
            content: "Be brief.".into(),
        },
        user("Hi\nthere"),
    ];
    let prompt = rendered_chat(&messages, &RenderOptions::generation());
    assert_eq!(answer["object"], "chat.completion");
    assert!(answer["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(ids(&answer["prompt_token_ids"]), prompt);
    let requests = f.echo.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(prompt_ids(&requests[0]), prompt);
    assert_eq!(requests[0].params.max_tokens, Some(6));
    assert_eq!(requests[0].params.temperature, Some(0.7));
    assert_eq!(requests[0].params.top_p, Some(0.95));
    assert_eq!(requests[0].params.stop, ["never"]);
    assert_eq!(requests[0].params.seed, Some(5));
    assert_ne!(requests[1].params.seed, Some(5));

    // The echo of the rendered prompt's last tokens, cut at 6.
    let window = &echo_window(&prompt)[..6];
    let content = tokenizer().decode(window, false).unwrap();
    let choices = answer["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (index, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], index);
        assert_eq!(
            choice["message"],
            json!({"role": "assistant", "content": content})
        );
        assert_eq!(choice["finish_reason"], "length");
        assert_eq!(ids(&choice["token_ids"]), window);
        let entries = choice["logprobs"]["content"].as_array().unwrap();
        assert_eq!(entries.len(), 6);
        let seed = requests[index].params.seed.unwrap();
        for (i, entry) in entries.iter().enumerate() {
            let expected = -0.25 * (i as f32 + 1.0) - 0.0625 * (seed % 4) as f32;
            assert_eq!(entry["logprob"].as_f64().unwrap() as f32, expected);
            // vLLM's list: the sampled token first, then the most likely others, `top_logprobs` in all.
            let top = entry["top_logprobs"].as_array().unwrap();
            assert_eq!(top[0]["token"], entry["token"]);
            assert_eq!(top[0]["bytes"], entry["bytes"]);
            let top_lps: Vec<f32> = top
                .iter()
                .map(|alt| alt["logprob"].as_f64().unwrap() as f32)
                .collect();
            assert_eq!(top_lps, [expected, expected - 1.0, expected - 2.0]);
            let bytes: Vec<u8> = entry["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect();
            assert_eq!(entry["token"], String::from_utf8_lossy(&bytes).as_ref());
        }
        let all: Vec<u8> = entries
            .iter()
            .flat_map(|entry| entry["bytes"].as_array().unwrap().clone())
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(String::from_utf8(all).unwrap(), content);
    }
    assert_eq!(
        answer["usage"],
        json!({"prompt_tokens": prompt.len(), "completion_tokens": 12,
               "total_tokens": prompt.len() + 12})
    );

    // Defaults: no logprobs, one choice, the generation prompt; the special tokens show as themselves.
    f.echo.clear();
    let answer = f
        .ok(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hey"}]}),
        )
        .await;
    let choice = &answer["choices"][0];
    assert_eq!(choice["logprobs"], Value::Null);
    assert_eq!(choice["finish_reason"], "stop");
    assert!(choice["message"]["content"]
        .as_str()
        .unwrap()
        .ends_with("<|im_end|>\n<|im_start|>assistant\n"));
    assert_eq!(f.echo.requests()[0].params.max_tokens, None);

    // continue_final_message (vLLM) renders the final assistant message open; chat_template_kwargs reach
    // the template; return_tokens_as_token_ids applies to chat logprobs too.
    f.echo.clear();
    let answer = f
        .ok(
            "/v1/chat/completions",
            json!({
                "messages": [{"role": "user", "content": "Hey"}, {"role": "assistant", "content": "Well,"}],
                "add_generation_prompt": false,
                "continue_final_message": true,
                "chat_template_kwargs": {"enable_thinking": false},
                "logprobs": true,
                "return_tokens_as_token_ids": true,
            }),
        )
        .await;
    let continued = rendered_chat(
        &[
            user("Hey"),
            ChatMessage {
                role: Role::Assistant,
                content: "Well,".into(),
            },
        ],
        &RenderOptions::continuation(),
    );
    assert!(tokenizer()
        .decode(&continued, false)
        .unwrap()
        .ends_with("assistant\nWell,"));
    assert_eq!(prompt_ids(&f.echo.requests()[0]), continued);
    let tail = echo_window(&continued);
    let tokens: Vec<Value> = answer["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["token"].clone())
        .collect();
    let expected: Vec<Value> = tail
        .iter()
        .map(|id| json!(format!("token_id:{id}")))
        .collect();
    assert_eq!(tokens, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_errors() {
    let f = start().await;
    // Bad JSON: serde's line and column.
    let (status, answer) = f
        .post_raw("/v1/completions", "{\"prompt\": \"x\",\n  \"n\": }")
        .await;
    assert_eq!(status, 400);
    let error = check_error_shape(&answer);
    assert_eq!(error["code"], "invalid_json");
    let message = error["message"].as_str().unwrap();
    assert!(message.contains("line 2 column"), "{message}");
    let (status, answer) = f.post_raw("/v1/chat/completions", "[1, 2]").await;
    assert_eq!(status, 400);
    assert!(check_error_shape(&answer)["message"]
        .as_str()
        .unwrap()
        .contains("must be a JSON object"));

    let cases: Vec<(&str, Value, &str, &str)> = vec![
        ("/v1/completions", json!({}), "prompt", "required"),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": "5"}),
            "max_tokens",
            "integer",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}),
            "max_tokens",
            "integer",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": -3}),
            "max_tokens",
            "-3",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": -1}),
            "temperature",
            "≥ 0",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": "hot"}),
            "temperature",
            "number",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_p": 0}),
            "top_p",
            "(0, 1]",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_p": 1.5}),
            "top_p",
            "(0, 1]",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_k": -2}),
            "top_k",
            "top_k",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 0}),
            "n",
            "1 to 128",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 129}),
            "n",
            "1 to 128",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": 3}),
            "stop",
            "string",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": ["a", 1]}),
            "stop",
            "string",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": [""]}),
            "stop",
            "empty",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "seed": 1.5}),
            "seed",
            "64-bit",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": true}),
            "logprobs",
            "0 to 20",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 21}),
            "logprobs",
            "0 to 20",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true,
                   "top_logprobs": 21}),
            "top_logprobs",
            "0 to 20",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": "s".repeat(16 << 20)}),
            "stop",
            "at most 128 stop strings of 16384 bytes in all",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": vec!["s"; 129]}),
            "stop",
            "has 129 strings",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "echo": true}),
            "echo",
            "`echo` is not supported on /v1/chat/completions",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stream_options": {"include_usage": true}}),
            "stream_options",
            "only allowed when `stream` is true",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}}),
            "stream_options",
            "must be a boolean",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stream": "yes"}),
            "stream",
            "true or false",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logit_bias": {"1": 500}}),
            "logit_bias",
            "from -100 to 100",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "best_of": 3}),
            "best_of",
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "suffix": "y"}),
            "suffix",
            "not supported",
        ),
        ("/v1/completions", json!({"prompt": []}), "prompt", "empty"),
        ("/v1/completions", json!({"prompt": ""}), "prompt", "empty"),
        (
            "/v1/completions",
            json!({"prompt": [[1, 2], []]}),
            "prompt",
            "prompt 1 is empty",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, -2]}),
            "prompt",
            "non-negative",
        ),
        (
            "/v1/completions",
            json!({"prompt": vec!["x"; 33], "n": 128}),
            "prompt",
            "at most 4096",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 100000]}),
            "prompt",
            "out of the vocabulary",
        ),
        (
            "/v1/completions",
            json!({"prompt": [[1], "x"]}),
            "prompt",
            "list of token-id lists",
        ),
        (
            "/v1/completions",
            json!({"prompt": {"text": "x"}}),
            "prompt",
            "a string, a list",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "model": 3}),
            "model",
            "string",
        ),
        ("/v1/chat/completions", json!({}), "messages", "required"),
        (
            "/v1/chat/completions",
            json!({"messages": []}),
            "messages",
            "empty",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}),
            "messages",
            "list of messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"content": "hi"}]}),
            "messages",
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages",
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages",
            "only text parts",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
            "top_logprobs",
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}),
            "logprobs",
            "true or false",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": true}),
            "continue_final_message",
            "add_generation_prompt",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
            "tools",
            "`tools[0].function` must be an object",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
            "does not render `tools`",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}),
            "tool_choice",
            "needs `tools`",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
            "tools are for /v1/chat/completions",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
            "response_format",
            "must be an object",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "guided_choice": []}),
            "guided_choice",
            "non-empty list of strings",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": []}),
            "stream_options",
            "must be an object",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}),
            "max_completion_tokens",
            "integer",
        ),
    ];
    for (path, body, param, needle) in cases {
        let error = f.fails(path, body.clone(), 400).await;
        assert_eq!(error["type"], "invalid_request_error");
        assert_eq!(error["param"], param, "{body}: {error}");
        let message = error["message"].as_str().unwrap();
        assert!(
            message.contains(needle),
            "{body}: {message:?} lacks {needle:?}"
        );
    }
    // A template that fails: the fixture's template concatenates `content`, so a null content fails.
    let error = f
        .fails(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": null}]}),
            400,
        )
        .await;
    assert_eq!(error["code"], "chat_template_error");

    // Unknown model: 404, as OpenAI and vLLM answer.
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let error = f
            .fails(
                path,
                json!({"model": "gpt-9", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
                404,
            )
            .await;
        assert_eq!(error["code"], "model_not_found");
        assert_eq!(error["param"], "model");
        assert!(error["message"].as_str().unwrap().contains("gpt-9"));
    }
    // Neutral values of refused fields, and unknown fields, pass.
    f.ok(
        "/v1/completions",
        json!({"prompt": "x", "echo": false, "logit_bias": {}, "presence_penalty": 0,
               "frequency_penalty": 0.0, "best_of": 1, "user": "me", "stream": false,
               "suffix": null, "whatever": [1]}),
    )
    .await;
    assert!(
        f.echo.requests().len() == 1,
        "failed requests never reach the sampler"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampler_errors_map_to_statuses() {
    let f = start().await;
    let error = f
        .fails("/v1/completions", json!({"prompt": "UNAVAILABLE"}), 503)
        .await;
    assert_eq!(error["type"], "server_error");
    assert_eq!(error["code"], "sampler_unavailable");
    assert!(error["message"]
        .as_str()
        .unwrap()
        .contains("the test says so"));
    let error = f
        .fails("/v1/completions", json!({"prompt": "MALFORMED"}), 500)
        .await;
    assert_eq!(error["code"], "sampler_error");
    // A full queue: 429, and when to come back.
    let response = f
        .client
        .post(format!("{}/v1/completions", f.base))
        .header("content-type", "application/json")
        .body(json!({"prompt": "OVERLOADED"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 429);
    assert_eq!(response.headers()["retry-after"], "1");
    let body: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
    let error = check_error_shape(&body);
    assert_eq!(error["code"], "server_overloaded");
    let error = f
        .fails(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "PANIC"}]}),
            500,
        )
        .await;
    assert!(error["message"].as_str().unwrap().contains("panicked"));
    // The server goes on after a panicking batch.
    f.ok("/v1/completions", json!({"prompt": "fine"})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_length() {
    let f = start_with(ServeConfig::default(), Some(40), Duration::ZERO).await;
    let (_, models) = f.get("/v1/models").await;
    assert_eq!(models["data"][0]["max_model_len"], 40);
    let long = "word ".repeat(50);
    let error = f
        .fails("/v1/completions", json!({"prompt": long}), 400)
        .await;
    assert_eq!(error["code"], "context_length_exceeded");
    assert!(error["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length is 40"));
    // 8 MB cannot be spelled in 40 tokens of this vocabulary: refused by its length, before the
    // tokenizer spends time and memory on it, in the completion prompt as in a chat message.
    let huge = "x".repeat(8 << 20);
    for (path, body) in [
        ("/v1/completions", json!({"prompt": huge})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": huge}]}),
        ),
    ] {
        let error = f.fails(path, body, 400).await;
        assert_eq!(error["code"], "context_length_exceeded");
        let message = error["message"].as_str().unwrap();
        assert!(
            message.contains("more than any 40 tokens can spell"),
            "{message}"
        );
    }
    let error = f
        .fails(
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 40}),
            400,
        )
        .await;
    assert_eq!(error["code"], "context_length_exceeded");
    // Chat without max_tokens samples the rest of the context.
    f.ok(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    let prompt = rendered_chat(&[user("hi")], &RenderOptions::generation());
    let requests = f.echo.requests();
    assert_eq!(
        requests[0].params.max_tokens,
        Some(40 - prompt.len() as u32)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_limit() {
    let f = start_with(
        ServeConfig {
            max_body_bytes: 1000,
            ..ServeConfig::default()
        },
        None,
        Duration::ZERO,
    )
    .await;
    let error = f
        .fails("/v1/completions", json!({"prompt": "x".repeat(2000)}), 413)
        .await;
    assert_eq!(error["code"], "body_too_large");
}
