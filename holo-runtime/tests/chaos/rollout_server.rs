//! The rollout server fails under `holo eval --sampler openai`: it dies while it holds a request (a
//! loopback stub that dies, and `holo serve` SIGKILLed through a loopback relay), it accepts and never
//! answers, it stalls its answer's body (by length and chunked), it answers 5xx and then recovers,
//! and `holo serve` is SIGSTOPped (and SIGCONTed while the client retries, or only after the run).
//!
//! In every case the run ends within its deadline; a rollout that could not be sampled fails alone, its
//! record naming the fault (the request's deadline, the refused connection, the status); the others
//! complete; and `--resume` against a healthy server runs exactly the failed ones again, with the seeds
//! they had, keeping the completed records as they were. Which request meets the fault is the case's
//! seed: the fault is triggered by the request's index or by its row, never by a clock.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::common::served::Served;
use crate::common::tempdir::Dir;
use crate::faults::{chat_answer, Act, FaultServer};
use crate::support::{
    completed, each_seed, failures, fixture, question, records, rows, run, signal, strings,
};

/// Rows of every case: each is one rollout (`-n 1`), one request.
const ROWS: usize = 4;
/// What every run, with its retries and deadlines, must end within.
const LIMIT: Duration = Duration::from_secs(60);
/// The reply of a healthy stub.
const REPLY: &str = "<answer>42</answer>";

/// `holo eval` of the short test environment on [`ROWS`] rows against the server at `url` serving
/// `model`, one request at a time when `concurrency` is 1, with a request deadline of `timeout` seconds
/// and `retries` retries.
fn eval_args(
    dir: &Path,
    url: &str,
    model: &str,
    concurrency: usize,
    seed: u64,
    timeout: &str,
    retries: u32,
) -> Vec<String> {
    let rows = rows(dir, ROWS);
    strings(&[
        "eval",
        &fixture("train/short.hol"),
        "--data",
        rows.to_str().unwrap(),
        "--out",
        dir.join("rollouts.jsonl").to_str().unwrap(),
        "--sampler",
        "openai",
        "--base-url",
        url,
        "--model",
        model,
        "--concurrency",
        &concurrency.to_string(),
        "--seed",
        &seed.to_string(),
        "--request-timeout",
        timeout,
        "--retries",
        &retries.to_string(),
    ])
}

/// `args` with `--base-url` changed to `url` and `--resume` added.
fn resumed(mut args: Vec<String>, url: &str) -> Vec<String> {
    let at = args.iter().position(|arg| arg == "--base-url").unwrap();
    args[at + 1] = url.to_string();
    args.push("--resume".into());
    args
}

/// Resumes the run of `args` in `dir` against `url` and checks what nothing may lose: it completes
/// every rollout, the ones completed before are kept as they were, and the server is asked only for
/// the ones that had failed. Returns the run's output.
fn resume_completes(dir: &Path, args: Vec<String>, url: &str, before: &[Value]) -> String {
    let (code, output) = run(dir, "resumed", &resumed(args, url), LIMIT);
    assert_eq!(code, 0, "the resumed run failed:\n{output}");
    let after = records(&dir.join("rollouts.jsonl"));
    let done_before = completed(before);
    let done_after = completed(&after);
    assert_eq!(done_after.len(), ROWS, "{output}");
    for (key, record) in &done_before {
        let kept = done_after.iter().find(|(at, _)| at == key).map(|(_, r)| r);
        assert_eq!(
            kept,
            Some(record),
            "rollout {key:?}, done before the fault, changed"
        );
    }
    assert!(
        output.contains(&format!(
            "{} rollouts done, {} failed ones to run again",
            done_before.len(),
            ROWS - done_before.len()
        )),
        "{output}"
    );
    output
}

/// The seeds the server saw with the requests of `row`, in arrival order.
fn seeds_of(seen: &[Value], row: usize) -> Vec<u64> {
    seen.iter()
        .filter(|body| body["messages"].to_string().contains(&question(row)))
        .map(|body| body["seed"].as_u64().unwrap())
        .collect()
}

#[test]
fn a_server_that_dies_holding_a_request_fails_the_rollouts_it_owed_and_resume_completes_them() {
    // Seed k: the server answers k requests, then dies holding the next (the connection closes
    // unanswered, the port refuses from then on).
    each_seed(&[0, 1, 2, 3], |seed| {
        let answered = seed as usize;
        let dir = Dir::new("chaos-dies");
        let dying = FaultServer::start(move |_, index| {
            if index < answered {
                Act::Answer(chat_answer(REPLY))
            } else {
                Act::Die
            }
        });
        let args = eval_args(&dir, &dying.url, "stub", 1, seed, "10", 1);
        let (code, output) = run(&dir, "dies", &args, LIMIT);
        assert_eq!(code, 1, "{output}");
        let before = records(&dir.join("rollouts.jsonl"));
        assert_eq!(before.len(), ROWS, "every rollout is written: {output}");
        assert_eq!(completed(&before).len(), answered, "{output}");
        let failed = failures(&before);
        assert_eq!(failed.len(), ROWS - answered, "{output}");
        for message in &failed {
            assert!(
                message.contains(&format!("POST {}/v1/chat/completions", dying.url))
                    && message.contains("cannot connect")
                    && message.contains("(gave up after 2 attempts)"),
                "{message}"
            );
        }
        assert_eq!(
            dying.seen().len(),
            answered + 1,
            "one request met the death"
        );

        let healthy = FaultServer::start(|_, _| Act::Answer(chat_answer(REPLY)));
        resume_completes(&dir, args, &healthy.url, &before);
        assert_eq!(healthy.seen().len(), ROWS - answered);
        assert_eq!(
            seeds_of(&healthy.seen(), answered),
            seeds_of(&dying.seen(), answered),
            "the rollout the server died on is sampled again with its seed"
        );
    });
}

/// A rollout's failure after both attempts of its request ran past the 1 s deadline.
fn assert_timed_out_twice(failure: &str) {
    assert!(
        failure.contains("timed out after 1s (request_timeout)")
            && failure.contains("(gave up after 2 attempts)"),
        "{failure}"
    );
}

/// `holo serve` of the committed tiny Qwen2, served under its folder's path (what `--model` sends).
fn serve_tiny() -> Served {
    let model = fixture("models/qwen2");
    Served::start(&mut crate::common::holo_command(&[
        "serve", &model, "--port", "0",
    ]))
}

/// The socket address of a served base URL.
fn address(served: &Served) -> std::net::SocketAddr {
    served
        .base
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .unwrap()
}

#[test]
fn a_served_model_killed_holding_a_request_fails_what_it_owed_and_resume_completes_it() {
    // Seed k: a loopback relay passes k requests to `holo serve`, then passes it the next and SIGKILLs
    // it before its answer can come back, and refuses from then on, as the port of a dead server does.
    each_seed(&[1, 2], |seed| {
        let answered = seed as usize;
        let dir = Dir::new("chaos-killed");
        let mut served = serve_tiny();
        let backend = address(&served);
        let pid = served.child.id();
        let relay = FaultServer::start(move |_, index| {
            if index < answered {
                Act::Forward(backend)
            } else {
                Act::ForwardAndDie(backend, Box::new(move || signal(pid, libc::SIGKILL)))
            }
        });
        let model = fixture("models/qwen2");
        let args = eval_args(&dir, &relay.url, &model, 1, seed, "10", 1);
        let (code, output) = run(&dir, "killed", &args, LIMIT);
        assert_eq!(code, 1, "{output}");
        let status = served.child.wait().unwrap();
        assert!(!status.success(), "holo serve was killed: {status}");
        let before = records(&dir.join("rollouts.jsonl"));
        assert_eq!(completed(&before).len(), answered, "{output}");
        for message in failures(&before) {
            assert!(
                message.contains("cannot connect") && message.contains("gave up after 2 attempts"),
                "{message}"
            );
        }

        let restarted = serve_tiny();
        resume_completes(&dir, args, &restarted.base, &before);
    });
}

#[test]
fn a_server_that_accepts_and_never_answers_is_named_by_the_request_deadline() {
    // Seed s: the server never answers the requests of row s, and answers the others.
    each_seed(&[0, 1, 3], |seed| {
        let silent_row = seed as usize;
        let dir = Dir::new("chaos-silent");
        let silent = FaultServer::start(move |request, _| {
            if request.prompt().contains(&question(silent_row)) {
                Act::Silent
            } else {
                Act::Answer(chat_answer(REPLY))
            }
        });
        let args = eval_args(&dir, &silent.url, "stub", ROWS, seed, "1", 1);
        let (code, output) = run(&dir, "silent", &args, LIMIT);
        assert_eq!(code, 1, "{output}");
        let before = records(&dir.join("rollouts.jsonl"));
        let failed = failures(&before);
        assert_eq!(failed.len(), 1, "{output}");
        assert_timed_out_twice(&failed[0]);
        assert!(
            output.contains(&format!(
                "rollout 0: sampler unavailable: POST {}",
                silent.url
            )),
            "the run names the failure: {output}"
        );
        assert_eq!(seeds_of(&silent.seen(), silent_row).len(), 2, "tried twice");

        let healthy = FaultServer::start(|_, _| Act::Answer(chat_answer(REPLY)));
        resume_completes(&dir, args, &healthy.url, &before);
        assert_eq!(
            seeds_of(&healthy.seen(), silent_row)[0],
            seeds_of(&silent.seen(), silent_row)[0]
        );
        assert_eq!(healthy.seen().len(), 1, "only the failed rollout again");
    });
}

#[test]
fn a_stalled_answer_body_is_cut_by_the_request_deadline() {
    // Seed s: the answers to row s stall halfway through their body: by content-length for even
    // seeds, as a chunked body for odd ones.
    each_seed(&[0, 1, 2, 3], |seed| {
        let stalled_row = seed as usize;
        let dir = Dir::new("chaos-stalled");
        let stalled = FaultServer::start(move |request, _| {
            let answer = chat_answer(REPLY);
            match request.prompt().contains(&question(stalled_row)) {
                false => Act::Answer(answer),
                true if seed % 2 == 0 => Act::StallBody(answer),
                true => Act::StallChunked(answer),
            }
        });
        let args = eval_args(&dir, &stalled.url, "stub", ROWS, seed, "1", 1);
        let (code, output) = run(&dir, "stalled", &args, LIMIT);
        assert_eq!(code, 1, "{output}");
        let before = records(&dir.join("rollouts.jsonl"));
        let failed = failures(&before);
        assert_eq!(failed.len(), 1, "{output}");
        assert_timed_out_twice(&failed[0]);
        let healthy = FaultServer::start(|_, _| Act::Answer(chat_answer(REPLY)));
        resume_completes(&dir, args, &healthy.url, &before);
        assert_eq!(healthy.seen().len(), 1, "only the failed rollout again");
    });
}

#[test]
fn a_server_that_answers_5xx_is_retried_through_and_named_when_it_does_not_recover() {
    // Seed s: every request of row s is answered 500, 502, 503 in turn, `s + 1` times, then properly.
    // Three retries ride out up to three errors; four fail the rollout naming the last status.
    each_seed(&[0, 2, 3], |seed| {
        let failing_row = seed as usize;
        let errors = seed as usize + 1;
        let dir = Dir::new("chaos-5xx");
        let counts = std::sync::Arc::new(std::sync::Mutex::new(0usize));
        let seen = std::sync::Arc::clone(&counts);
        let server = FaultServer::start(move |request, _| {
            if !request.prompt().contains(&question(failing_row)) {
                return Act::Answer(chat_answer(REPLY));
            }
            let mut attempt = seen.lock().unwrap();
            *attempt += 1;
            if *attempt <= errors {
                Act::Status([500, 502, 503][(*attempt - 1) % 3])
            } else {
                Act::Answer(chat_answer(REPLY))
            }
        });
        let args = eval_args(&dir, &server.url, "stub", ROWS, seed, "10", 3);
        let (code, output) = run(&dir, "5xx", &args, LIMIT);
        let attempts = *counts.lock().unwrap();
        let written = records(&dir.join("rollouts.jsonl"));
        if errors <= 3 {
            assert_eq!(code, 0, "{output}");
            assert_eq!(completed(&written).len(), ROWS);
            assert_eq!(attempts, errors + 1, "retried until it recovered");
        } else {
            assert_eq!(code, 1, "{output}");
            let failed = failures(&written);
            assert_eq!(failed.len(), 1, "{output}");
            assert!(
                failed[0].contains("HTTP 500: injected HTTP 500")
                    && failed[0].contains("(gave up after 4 attempts)"),
                "{}",
                failed[0]
            );
            assert_eq!(attempts, 4, "one attempt and three retries");
            let healthy = FaultServer::start(|_, _| Act::Answer(chat_answer(REPLY)));
            resume_completes(&dir, args, &healthy.url, &written);
        }
    });
}

#[test]
fn a_sigstopped_server_times_out_and_a_retry_after_sigcont_completes_the_rollout() {
    // Seed k: requests reach `holo serve` through a loopback relay; the relay SIGSTOPs it before passing
    // it request k, and SIGCONTs it before passing it the next request, which is request k's retry.
    each_seed(&[0, 2], |seed| {
        let stopped_at = seed as usize;
        let dir = Dir::new("chaos-sigstop");
        let served = serve_tiny();
        let backend = address(&served);
        let pid = served.child.id();
        let relay = FaultServer::start(move |_, index| match index {
            _ if index == stopped_at => {
                Act::ForwardAfter(backend, Box::new(move || signal(pid, libc::SIGSTOP)))
            }
            _ if index == stopped_at + 1 => {
                Act::ForwardAfter(backend, Box::new(move || signal(pid, libc::SIGCONT)))
            }
            _ => Act::Forward(backend),
        });
        let model = fixture("models/qwen2");
        let args = eval_args(&dir, &relay.url, &model, 1, seed, "1", 2);
        let (code, output) = run(&dir, "sigstop", &args, LIMIT);
        assert_eq!(
            code, 0,
            "the retry after SIGCONT completes the rollout:\n{output}"
        );
        assert_eq!(completed(&records(&dir.join("rollouts.jsonl"))).len(), ROWS);
        let seen = relay.seen();
        assert_eq!(seen.len(), ROWS + 1, "one retry");
        assert_eq!(
            seen[stopped_at]["seed"],
            seen[stopped_at + 1]["seed"],
            "the request after the stop is the stopped one's retry: its deadline fired"
        );
    });
}

#[test]
fn a_server_sigstopped_for_good_fails_the_rest_naming_the_deadline_and_resume_completes_them() {
    // Seed k: the relay SIGSTOPs `holo serve` before passing it request k; it stays stopped until the
    // run ends, then is SIGCONTed and the run resumed against it.
    each_seed(&[1, 2], |seed| {
        let stopped_at = seed as usize;
        let dir = Dir::new("chaos-stopped");
        let served = serve_tiny();
        let backend = address(&served);
        let pid = served.child.id();
        let relay = FaultServer::start(move |_, index| {
            if index == stopped_at {
                Act::ForwardAfter(backend, Box::new(move || signal(pid, libc::SIGSTOP)))
            } else {
                Act::Forward(backend)
            }
        });
        let model = fixture("models/qwen2");
        let args = eval_args(&dir, &relay.url, &model, 1, seed, "1", 0);
        let (code, output) = run(&dir, "stopped", &args, LIMIT);
        assert_eq!(code, 1, "{output}");
        let before = records(&dir.join("rollouts.jsonl"));
        assert_eq!(completed(&before).len(), stopped_at, "{output}");
        let failed = failures(&before);
        assert_eq!(failed.len(), ROWS - stopped_at, "{output}");
        for message in failed {
            assert!(
                message.contains("timed out after 1s (request_timeout)")
                    && message.contains("(gave up after 1 attempt)"),
                "{message}"
            );
        }
        signal(pid, libc::SIGCONT);
        resume_completes(&dir, args, &served.base, &before);
    });
}
