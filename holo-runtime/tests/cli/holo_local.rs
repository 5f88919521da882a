//! `holo eval` / `holo dry` with `--sampler local`: a model folder sampled in process.

use std::process::Output;

use serde_json::Value;

use crate::common::{holo_command, repo};

const MODEL: &str = "holo-runtime/tests/fixtures/models/qwen2";

fn holo(args: &[&str]) -> Output {
    holo_command(args).output().expect("holo runs")
}

fn scratch(name: &str) -> String {
    let dir = std::env::temp_dir().join(format!("holo-local-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name).display().to_string()
}

fn eval(out: &str, seed: &str) -> Output {
    holo(&[
        "eval",
        "hol/qa.hol",
        "--data",
        "examples/data/capitals.jsonl",
        "-n",
        "2",
        "--seed",
        seed,
        "--sampler",
        "local",
        "--model",
        MODEL,
        "--out",
        out,
    ])
}

fn records(path: &str) -> Vec<Value> {
    let lines: Vec<String> = std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    let mut records: Vec<Value> = lines
        .iter()
        .map(|line| {
            let mut record: Value = serde_json::from_str(line).unwrap();
            // Wall-clock times differ between runs; nothing else may.
            record.as_object_mut().unwrap().remove("timing");
            record
        })
        .collect();
    records.sort_by_key(|record| {
        (
            record["row_index"].as_u64(),
            record["rollout_index"].as_u64(),
        )
    });
    records
}

#[test]
fn eval_samples_a_local_model_token_by_token_reproducibly() {
    let (first, second, other) = (scratch("a.jsonl"), scratch("b.jsonl"), scratch("c.jsonl"));
    let output = eval(&first, "7");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let rows = std::fs::read_to_string(repo().join("examples/data/capitals.jsonl"))
        .unwrap()
        .lines()
        .filter(|line| !line.trim().is_empty())
        .count();
    let written = records(&first);
    assert_eq!(written.len(), rows * 2);
    for record in &written {
        let context = &record["contexts"][0];
        let tokens = &context["tokens"];
        let mask = tokens["loss_mask"].as_array().unwrap();
        let logprobs = tokens["logprobs"].as_array().unwrap();
        assert_eq!(mask.len(), tokens["ids"].as_array().unwrap().len());
        let trained: Vec<f64> = mask
            .iter()
            .zip(logprobs)
            .filter(|(m, _)| m.as_u64() == Some(1))
            .map(|(_, l)| l.as_f64().unwrap())
            .collect();
        assert!(!trained.is_empty(), "the model's tokens are trained");
        assert!(
            trained.iter().all(|&l| l <= 0.0) && trained.iter().any(|&l| l < 0.0),
            "sampled tokens carry the policy's log-probabilities: {trained:?}"
        );
    }

    assert_eq!(eval(&second, "7").status.code(), Some(0));
    // The same seed samples the same rollouts, whatever shared their batches (which moves the
    // log-probabilities by float rounding only).
    let again = records(&second);
    assert_eq!(written.len(), again.len());
    for (a, b) in written.iter().zip(&again) {
        crate::common::json::assert_close(a, b, "the same seed samples the same rollouts");
    }
    assert_eq!(eval(&other, "8").status.code(), Some(0));
    assert!(
        written != records(&other),
        "another seed samples other rollouts"
    );
}

#[test]
fn dry_runs_a_local_model() {
    let output = holo(&[
        "dry",
        "hol/qa.hol",
        "--data",
        "examples/data/capitals.jsonl",
        "--sampler",
        "local",
        "--model",
        MODEL,
        "--color",
        "never",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("=== context 0 (trained)") && stdout.contains('⟦'),
        "{stdout}"
    );
}

#[test]
fn local_sampler_usage_errors() {
    let missing = holo(&["dry", "hol/qa.hol", "--sampler", "local"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("--model"));

    let not_a_model = holo(&["dry", "hol/qa.hol", "--sampler", "local", "--model", "hol"]);
    assert_eq!(not_a_model.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&not_a_model.stderr);
    assert!(
        stderr.contains("--model `hol`") && stderr.contains("config.json"),
        "{stderr}"
    );

    let replies = holo(&[
        "dry",
        "hol/qa.hol",
        "--sampler",
        "local",
        "--model",
        MODEL,
        "--reply",
        "Paris",
    ]);
    assert_eq!(replies.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&replies.stderr).contains("--reply is for the scripted sampler")
    );
}

/// Kills the server when the test ends, passing or not.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn eval_through_holo_serve_sends_token_prompts_and_records_tokens() {
    use std::io::BufRead;
    use std::process::Stdio;

    let mut server = Server(
        holo_command(&["serve", MODEL, "--port", "0"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("holo serve starts"),
    );
    let stderr = server.0.stderr.take().unwrap();
    let mut lines = std::io::BufReader::new(stderr).lines();
    let base = loop {
        let line = lines
            .next()
            .expect("holo serve says where it listens")
            .unwrap();
        if let Some(at) = line.find("http://") {
            break line[at..].split_whitespace().next().unwrap().to_string();
        }
    };
    // The served model's name is its folder, which also has a tokenizer: the Loom works in token space
    // and sends `/v1/completions` requests with token-id prompts.
    let out = scratch("served.jsonl");
    let output = holo(&[
        "eval",
        "hol/qa.hol",
        "--data",
        "examples/data/capitals.jsonl",
        "-n",
        "2",
        "--sampler",
        "openai",
        "--base-url",
        &base,
        "--model",
        MODEL,
        "--out",
        &out,
    ]);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let written = records(&out);
    assert_eq!(written.len(), 4);
    for record in &written {
        let tokens = &record["contexts"][0]["tokens"];
        assert!(
            tokens["retokenized"].as_bool() != Some(true),
            "token ids came back exactly"
        );
        let trained: Vec<f64> = tokens["loss_mask"]
            .as_array()
            .unwrap()
            .iter()
            .zip(tokens["logprobs"].as_array().unwrap())
            .filter(|(m, _)| m.as_u64() == Some(1))
            .map(|(_, l)| l.as_f64().unwrap())
            .collect();
        assert!(!trained.is_empty() && trained.iter().any(|&l| l < 0.0));
    }
}

fn eval_with(out: &str, seed: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "eval",
        "hol/qa.hol",
        "--data",
        "examples/data/capitals.jsonl",
        "-n",
        "3",
        "--seed",
        seed,
        "--sampler",
        "local",
        "--model",
        MODEL,
        "--out",
        out,
    ];
    args.extend_from_slice(extra);
    holo(&args)
}

/// Takes the log-probabilities out of the records, all in one list.
fn logprobs(records: &mut [Value]) -> Vec<f64> {
    let mut all = Vec::new();
    for record in records {
        for context in record["contexts"].as_array_mut().unwrap() {
            let taken = context["tokens"]["logprobs"].take();
            all.extend(
                taken
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|l| l.as_f64().unwrap()),
            );
        }
    }
    all
}

#[test]
fn an_interrupted_eval_resumes_where_it_stopped() {
    let (full, cut) = (scratch("full.jsonl"), scratch("cut.jsonl"));
    assert_eq!(eval_with(&full, "3", &[]).status.code(), Some(0));
    let text = std::fs::read_to_string(&full).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6);
    // Two rollouts done, one that failed (a sampler error), and a line cut short by the interruption.
    let mut failed: Value = serde_json::from_str(lines[1]).unwrap();
    failed["error"] = serde_json::json!({"stage": "sampler", "message": "injected timeout"});
    let interrupted = format!(
        "{}\n{}\n{}\n{}",
        lines[0],
        failed,
        lines[2],
        &lines[3][..lines[3].len() / 2]
    );
    std::fs::write(&cut, interrupted).unwrap();

    let output = eval_with(&cut, "3", &["--resume"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("ignoring an unfinished last line"),
        "{stderr}"
    );
    assert!(
        stderr.contains("2 rollouts done, 1 failed ones to run again"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("6 rollouts, 0 failed"), "{stdout}");
    // Other batches (4 rollouts instead of 6) change the log-probabilities by float noise only.
    let (mut resumed, mut uninterrupted) = (records(&cut), records(&full));
    let (a, b) = (logprobs(&mut resumed), logprobs(&mut uninterrupted));
    assert!(
        resumed == uninterrupted,
        "the resumed run wrote what the uninterrupted one did"
    );
    assert_eq!(a.len(), b.len());
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-4));

    // Another seed would mix two runs: refused, and the file is left as it was.
    let before = std::fs::read_to_string(&cut).unwrap();
    let output = eval_with(&cut, "4", &["--resume"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("another run seed"));
    assert_eq!(std::fs::read_to_string(&cut).unwrap(), before);
}

#[test]
fn devices_and_precisions_are_checked_before_loading() {
    let refused = |extra: &[&str]| {
        let mut args = vec!["dry", "hol/qa.hol", "--sampler", "local", "--model", MODEL];
        args.extend_from_slice(extra);
        let output = holo(&args);
        assert_eq!(output.status.code(), Some(2), "{extra:?}");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    assert!(refused(&["--dtype", "f8"]).contains("unknown dtype \"f8\""));
    assert!(refused(&["--device", "tpu"]).contains("unknown device \"tpu\""));
    assert!(refused(&["--device", "cuda:x"]).contains("not a device number"));
    // A GPU is opened before the model loads: a build without the feature says how to get it, a build
    // with it names the device it could not open.
    #[cfg(not(feature = "cuda"))]
    for device in ["cuda", "cuda:0", "cuda:3"] {
        let stderr = refused(&["--device", device]);
        assert!(
            stderr.contains(&format!(
                "device {device:?}: this holo was built without CUDA"
            )) && stderr.contains("--features cuda"),
            "{stderr}"
        );
    }
    #[cfg(feature = "cuda")]
    {
        let stderr = refused(&["--device", "cuda:99"]);
        assert!(
            stderr.contains("device \"cuda:99\": cannot open CUDA device 99"),
            "{stderr}"
        );
    }
    #[cfg(not(feature = "metal"))]
    assert!(refused(&["--device", "metal"]).contains("this holo was built without Metal"));
    let serve = holo_command(&["serve", MODEL, "--port", "0", "--dtype", "f8"])
        .output()
        .unwrap();
    assert_eq!(serve.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&serve.stderr).contains("unknown dtype \"f8\""));
}

#[test]
fn f16_and_bf16_weights_run_on_the_cpu() {
    for dtype in ["f16", "bf16"] {
        let output = holo(&[
            "dry",
            "hol/qa.hol",
            "--data",
            "examples/data/capitals.jsonl",
            "--sampler",
            "local",
            "--model",
            MODEL,
            "--dtype",
            dtype,
            "--color",
            "never",
        ]);
        assert_eq!(
            output.status.code(),
            Some(0),
            "{dtype}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// The first lines `holo serve MODEL` writes to stderr, up to the one that says where it listens.
fn serve_banner(model: &str) -> String {
    use std::io::BufRead;
    use std::process::Stdio;

    let mut server = Server(
        holo_command(&["serve", model, "--port", "0"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("holo serve starts"),
    );
    let stderr = server.0.stderr.take().unwrap();
    let mut banner = String::new();
    for line in std::io::BufReader::new(stderr).lines() {
        let line = line.unwrap();
        banner.push_str(&line);
        banner.push('\n');
        if line.contains("http://") {
            return banner;
        }
    }
    panic!("holo serve ended without saying where it listens:\n{banner}");
}

#[test]
fn serving_a_folder_without_a_chat_template_says_so() {
    let note = "has no chat template";
    let with = serve_banner(MODEL);
    assert!(!with.contains(note), "{with}");

    let copy = crate::common::tempdir::Dir::with_files_of("no-template", &repo().join(MODEL));
    let config_file = copy.join("tokenizer_config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_file).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&config_file, config.to_string()).unwrap();
    let without = serve_banner(copy.to_str().unwrap());
    assert!(
        without.contains(note) && without.contains("ChatML"),
        "{without}"
    );
}
