//! Requests side by side: one sampler call per request, none holding up another.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_does_not_hold_up_another() {
    let f = start().await;
    // The HOLD request's sampler call waits until the RELEASE request has been answered: sampled one
    // after the other, the two would wait for each other (and the bounded wait fails the test).
    let held = f.post("/v1/completions", json!({"prompt": "HOLD me", "seed": 1}));
    let release = async {
        let answer = f
            .post(
                "/v1/completions",
                json!({"prompt": "RELEASE it", "seed": 2}),
            )
            .await;
        f.echo.released.notify_one();
        answer
    };
    let ((held_status, held), (status, released)) = tokio::join!(held, release);
    assert_eq!((held_status, status), (200, 200), "{held} {released}");
    assert_eq!(held["choices"][0]["text"], "HOLD me");
    assert_eq!(released["choices"][0]["text"], "RELEASE it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_is_one_sampler_call_with_its_n_samples() {
    let f = start().await;
    let requests = (0..4).map(|i| {
        f.post(
            "/v1/completions",
            json!({"prompt": format!("request {i}"), "n": 1 + i, "seed": 1}),
        )
    });
    for (i, (status, answer)) in futures_join_all(requests).await.into_iter().enumerate() {
        assert_eq!(status, 200);
        assert_eq!(answer["choices"].as_array().unwrap().len(), 1 + i);
    }
    let mut calls: Vec<(String, usize)> = f
        .echo
        .batches()
        .iter()
        .map(|batch| {
            let Prompt::Tokens(ids) = &batch[0].prompt else {
                panic!("token prompts")
            };
            let text = tokenizer().decode(ids, false).unwrap();
            assert!(batch
                .iter()
                .all(|request| request.prompt == batch[0].prompt));
            (text, batch.len())
        })
        .collect();
    calls.sort();
    let expected: Vec<(String, usize)> = (0..4).map(|i| (format!("request {i}"), 1 + i)).collect();
    assert_eq!(calls, expected);
}
