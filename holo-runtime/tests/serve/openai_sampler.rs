//! The runtime's own `openai` sampler as the client: token ids and logprobs round-trip exactly.

use super::*;

fn openai_client(base: &str) -> OpenAi {
    OpenAi::new(OpenAiConfig {
        proxy_from_env: false,
        max_retries: 0,
        api_key_env: "HOLO_SERVE_TEST_NO_SUCH_VAR".into(),
        ..OpenAiConfig::new(base, MODEL)
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_sampler_round_trips_tokens_and_logprobs() {
    let f = start().await;
    let client = openai_client(&f.base);
    let echo = Echo::new(Duration::ZERO);
    let params = |max_tokens: Option<u32>, stop: &[&str]| SampleParams {
        max_tokens,
        temperature: Some(0.8),
        top_p: Some(0.9),
        top_k: Some(20),
        stop: stop.iter().map(|s| s.to_string()).collect(),
        seed: Some(3),
        top_logprobs: 0,
        ..SampleParams::default()
    };
    let text = "Hé, 日本 ok";
    let tokens = encode(text);
    let chat = vec![
        ChatMessage {
            role: Role::System,
            content: "sys".into(),
        },
        user("Hello there"),
    ];
    let continued = vec![
        user("Hi"),
        ChatMessage {
            role: Role::Assistant,
            content: "Sure".into(),
        },
    ];
    let batch = vec![
        // End of turn, length, stop string; tokens, text and chat prompts.
        Request {
            prompt: Prompt::Tokens(tokens.clone()),
            params: params(None, &[]),
        },
        Request {
            prompt: Prompt::Tokens(tokens.clone()),
            params: params(Some(3), &[]),
        },
        Request {
            prompt: Prompt::Text("Hello world and more".into()),
            params: params(None, &[" and"]),
        },
        Request {
            prompt: Prompt::Chat(chat.clone()),
            params: params(Some(5), &[]),
        },
        Request {
            prompt: Prompt::Chat(continued.clone()),
            params: params(None, &["ure"]),
        },
    ];
    let results = client.sample(&batch).await;
    // What the test sampler answers for the same token prompts, directly.
    let token_prompts = [
        tokens.clone(),
        tokens.clone(),
        encode("Hello world and more"),
        rendered_chat(&chat, &RenderOptions::generation()),
        rendered_chat(&continued, &RenderOptions::continuation()),
    ];
    for ((request, result), prompt) in batch.iter().zip(results).zip(token_prompts) {
        let got = result.unwrap_or_else(|error| panic!("{request:?}: {error}"));
        let expected = echo
            .answer(
                &Request {
                    prompt: Prompt::Tokens(prompt),
                    params: request.params.clone(),
                },
                None,
            )
            .unwrap();
        // The server also says which weights answered: its own, version 0.
        let expected = Completion {
            weight_version: Some(0),
            constraint: None,
            ..expected
        };
        assert_eq!(got, expected, "{request:?}");
        assert!(!got.tokens.is_empty() && got.logprobs.len() == got.tokens.len());
    }
    let finishes: Vec<Finish> = f
        .echo
        .requests()
        .iter()
        .map(|request| echo.answer(request, None).unwrap().finish)
        .collect();
    assert!(finishes.contains(&Finish::EndOfTurn));
    assert!(finishes.contains(&Finish::Length));
    assert!(finishes.contains(&Finish::Stop(" and".into())));
    assert!(finishes.contains(&Finish::Stop("ure".into())));
    // Every parameter reached the test sampler as sent.
    for request in f.echo.requests() {
        assert_eq!(request.params.seed, Some(3));
        assert_eq!(request.params.top_k, Some(20));
        assert_eq!(request.params.temperature, Some(0.8));
    }
    // Errors come back as the sampler's errors.
    let failing = [Request {
        prompt: Prompt::Text("MALFORMED".into()),
        params: SampleParams::default(),
    }];
    let result = client.sample(&failing).await.pop().unwrap();
    assert!(
        matches!(&result, Err(SamplerError::Unavailable(message)) if message.contains("500")),
        "{result:?}"
    );
    let wrong_model = OpenAi::new(OpenAiConfig {
        proxy_from_env: false,
        max_retries: 0,
        api_key_env: "HOLO_SERVE_TEST_NO_SUCH_VAR".into(),
        ..OpenAiConfig::new(format!("{}/v1", f.base), "other")
    })
    .unwrap();
    let result = wrong_model.sample(&batch[..1]).await.pop().unwrap();
    assert!(
        matches!(&result, Err(SamplerError::Rejected(message)) if message.contains("404")),
        "{result:?}"
    );
}
