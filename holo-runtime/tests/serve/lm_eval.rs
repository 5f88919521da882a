//! lm-evaluation-harness (PyPI `lm-eval` 0.4.13) against the server, with the harness' own code: its
//! `local-completions` model (log-likelihoods through `echo` with prompt log-probabilities, greedy
//! generation through token-id prompts, batched) and `local-chat-completions` give the same answers as its
//! `hf` model (transformers in process) on the same folder, the tiny Qwen2 of
//! `tests/fixtures/models/qwen2`. The tasks are YAML files over JSONL files in `tests/fixtures/lm_eval`,
//! so nothing is downloaded.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use super::echo::{qwen2_dir, start_qwen2};
use super::*;
use crate::common::process::Process;
use crate::common::tempdir::Dir;

/// How long one `lm_eval` run may take (its imports alone take seconds).
const RUN_LIMIT: Duration = Duration::from_secs(300);

fn tasks_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lm_eval")
}

/// Runs `lm_eval` from `venv` with `args`, logging its samples under `out/NAME`; the samples of each
/// task by `doc_id`, and the aggregated results.
async fn evaluate(venv: &Path, out: &Dir, name: &str, args: Vec<String>) -> Evaluation {
    let output = out.path().join(name);
    let mut command = Command::new(venv.join("bin/lm_eval"));
    command
        .args(args)
        .args(["--include_path", "."])
        .args(["--log_samples", "--output_path"])
        .arg(&output)
        // The tasks' data files are named relative to their folder.
        .current_dir(tasks_dir())
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .env("HF_HOME", out.path().join("hf"))
        .env("HF_DATASETS_CACHE", out.path().join("datasets"))
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .env_remove("OPENAI_API_KEY");
    let log = out.path().join(format!("{name}.log"));
    let (status, log) = tokio::task::spawn_blocking(move || {
        let mut process = Process::spawn(&mut command, log);
        process.finish(RUN_LIMIT)
    })
    .await
    .unwrap();
    assert!(status.success(), "lm_eval {name} failed:\n{log}");
    Evaluation::read(&output)
}

/// What one `lm_eval` run wrote.
struct Evaluation {
    /// Per task, its samples' `filtered_resps` by `doc_id`.
    samples: BTreeMap<String, Vec<Value>>,
    /// `results` of the aggregated results file.
    results: Value,
}

impl Evaluation {
    fn read(output: &Path) -> Evaluation {
        let mut samples = BTreeMap::new();
        let mut results = Value::Null;
        let mut folders = vec![output.to_path_buf()];
        while let Some(folder) = folders.pop() {
            for entry in std::fs::read_dir(&folder).unwrap() {
                let path = entry.unwrap().path();
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                if path.is_dir() {
                    folders.push(path);
                } else if let Some(task) = name.strip_prefix("samples_") {
                    let task = task[..task.rfind('_').unwrap()].to_string();
                    let mut docs: Vec<(u64, Value)> = std::fs::read_to_string(&path)
                        .unwrap()
                        .lines()
                        .map(|line| {
                            let sample: Value = serde_json::from_str(line).unwrap();
                            (
                                sample["doc_id"].as_u64().unwrap(),
                                sample["filtered_resps"].clone(),
                            )
                        })
                        .collect();
                    docs.sort_by_key(|(id, _)| *id);
                    samples.insert(task, docs.into_iter().map(|(_, resps)| resps).collect());
                } else if name.starts_with("results_") {
                    let file: Value =
                        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
                    results = file["results"].clone();
                }
            }
        }
        assert!(!samples.is_empty(), "no samples under {}", output.display());
        Evaluation { samples, results }
    }

    fn task(&self, task: &str) -> &[Value] {
        self.samples
            .get(task)
            .unwrap_or_else(|| panic!("no samples of {task}: {:?}", self.samples.keys()))
    }
}

/// The model arguments of lm-eval's API models against `base`.
fn served_args(model: &str, base: &str, endpoint: &str, tokenizer: bool) -> String {
    let mut args =
        format!("model={model},base_url={base}/v1/{endpoint},max_retries=1,num_concurrent=2");
    if tokenizer {
        args += &format!(
            ",tokenizer_backend=huggingface,tokenizer={}",
            qwen2_dir().display()
        );
    }
    args
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|arg| arg.to_string()).collect()
}

/// `local-completions` scores the multiple-choice task's every choice as `hf` does (within 1e-4 per
/// log-likelihood, the same `is_greedy`, the same accuracies) and generates, greedily, exactly `hf`'s
/// continuations: the log-likelihoods go through `echo` with `logprobs` and `max_tokens: 1`, four
/// token-id prompts a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lm_eval_local_completions_matches_its_hf_model() {
    let Some(venv) = crate::common::components::lm_eval() else {
        return;
    };
    let server = start_qwen2().await;
    let out = Dir::new("lm-eval-completions");
    let tasks = ["--tasks", "holo_choice,holo_generate"];
    let hf_args = format!("pretrained={},dtype=float32", qwen2_dir().display());
    let mut hf = strings(&["--model", "hf", "--device", "cpu", "--model_args"]);
    hf.push(hf_args);
    hf.extend(strings(&tasks));
    let mut served = strings(&[
        "--model",
        "local-completions",
        "--batch_size",
        "4",
        "--model_args",
    ]);
    served.push(served_args(MODEL, &server.base_url(), "completions", true));
    served.extend(strings(&tasks));
    let (hf, served) = tokio::join!(
        evaluate(&venv, &out, "hf", hf),
        evaluate(&venv, &out, "served", served)
    );

    let (by_hf, by_server) = (hf.task("holo_choice"), served.task("holo_choice"));
    assert_eq!(by_hf.len(), 6);
    assert_eq!(by_hf.len(), by_server.len());
    let mut largest = 0f64;
    for (doc, (hf_doc, served_doc)) in by_hf.iter().zip(by_server).enumerate() {
        let (hf_doc, served_doc) = (hf_doc.as_array().unwrap(), served_doc.as_array().unwrap());
        assert_eq!(hf_doc.len(), served_doc.len(), "doc {doc}");
        for (hf_choice, served_choice) in hf_doc.iter().zip(served_doc) {
            let number = |value: &Value| value[0].as_str().unwrap().parse::<f64>().unwrap();
            let gap = (number(hf_choice) - number(served_choice)).abs();
            largest = largest.max(gap);
            assert!(
                gap < 1e-4,
                "doc {doc}: hf {hf_choice} against the server's {served_choice}"
            );
            assert_eq!(hf_choice[1], served_choice[1], "doc {doc}: is_greedy");
        }
    }
    eprintln!("lm-eval log-likelihoods: largest |hf - served| = {largest:.3e}");
    for metric in ["acc,none", "acc_norm,none"] {
        assert_eq!(
            hf.results["holo_choice"][metric], served.results["holo_choice"][metric],
            "{metric}"
        );
    }
    assert_eq!(hf.task("holo_generate"), served.task("holo_generate"));
    assert!(hf
        .task("holo_generate")
        .iter()
        .all(|resps| resps[0].as_str().is_some_and(|text| !text.is_empty())));
    server.shutdown().await.unwrap();
}

/// `local-chat-completions` with the chat template applied generates, greedily, exactly what `hf`
/// generates from the same template.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lm_eval_local_chat_completions_matches_its_hf_model() {
    let Some(venv) = crate::common::components::lm_eval() else {
        return;
    };
    let server = start_qwen2().await;
    let out = Dir::new("lm-eval-chat");
    let tasks = ["--tasks", "holo_generate", "--apply_chat_template"];
    let mut hf = strings(&["--model", "hf", "--device", "cpu", "--model_args"]);
    hf.push(format!(
        "pretrained={},dtype=float32",
        qwen2_dir().display()
    ));
    hf.extend(strings(&tasks));
    let mut served = strings(&["--model", "local-chat-completions", "--model_args"]);
    served.push(served_args(
        MODEL,
        &server.base_url(),
        "chat/completions",
        false,
    ));
    served.extend(strings(&tasks));
    let (hf, served) = tokio::join!(
        evaluate(&venv, &out, "hf", hf),
        evaluate(&venv, &out, "served", served)
    );
    assert_eq!(hf.task("holo_generate").len(), 6);
    assert_eq!(hf.task("holo_generate"), served.task("holo_generate"));
    assert!(hf
        .task("holo_generate")
        .iter()
        .any(|resps| resps[0].as_str().is_some_and(|text| !text.is_empty())));
    server.shutdown().await.unwrap();
}
