//! The memory plan of `holo train` (`holo_runtime::train::plan`): a run that fits writes
//! `memory_plan.json` and trains; one that cannot fit in the stated `memory_limit` is refused before its
//! weights are loaded, naming the option and the largest value of it that fits.

use std::path::{Path, PathBuf};

use crate::common::{fixture, holo_command, tiny_train};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("holo-memory-plan-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `holo train` on the committed tiny Qwen2 for one step with micro-batches of `batch` completions.
fn train(out: &Path, batch: usize, extra: &[&str]) -> std::process::Output {
    train_model("models/qwen2", out, batch, extra)
}

/// [`train`] on the committed `model` (relative to `tests/fixtures`).
fn train_model(model: &str, out: &Path, batch: usize, extra: &[&str]) -> std::process::Output {
    let mut args = tiny_train("train/short.hol", "train/rows.jsonl", out);
    args[3] = fixture(model);
    let batch = batch.to_string();
    args.extend(
        [
            "--max-steps",
            "1",
            "--num-generations",
            "2",
            "--per-device-train-batch-size",
            &batch,
            "--max-completion-length",
            "8",
            "--save-strategy",
            "no",
        ]
        .iter()
        .chain(extra)
        .map(|arg| arg.to_string()),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    holo_command(&args).output().unwrap()
}

fn peak(out: &Path) -> u64 {
    let text = std::fs::read_to_string(out.join("memory_plan.json")).unwrap();
    let plan: serde_json::Value = serde_json::from_str(&text).unwrap();
    // The micro-batch's phases: the head's backward, or a recomputed layer's.
    let phase = plan["peak"]["phase"].as_str().unwrap();
    assert!(["training", "backward"].contains(&phase), "{plan}");
    plan["peak"]["bytes"].as_u64().unwrap()
}

#[test]
fn a_run_that_cannot_fit_is_refused_naming_the_batch_that_fits() {
    let dir = scratch("refuse");
    let fits = dir.join("fits");
    let output = train(&fits, 2, &["--memory-limit", "100"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("memory plan (peak resident memory, by term):"),
        "{stderr}"
    );
    assert!(
        stderr.contains("of 100.0 GiB available (memory_limit)"),
        "{stderr}"
    );
    assert!(fits.join("metrics.jsonl").exists());
    let two = peak(&fits);

    // Exactly the plan of micro-batches of 2: 8 cannot fit, 2 is the largest that does.
    let limit = format!("{}", (two as f64 + 0.5) / (1u64 << 30) as f64);
    let refused = dir.join("refused");
    let output = train(&refused, 8, &["--memory-limit", &limit]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("error: memory plan: `--per-device-train-batch-size 2` fits; 8 needs"),
        "{stderr}"
    );
    assert!(
        stderr.contains("(training: ") || stderr.contains("(backward: "),
        "{stderr}"
    );
    assert!(stderr.contains("memory_check = \"warn\""), "{stderr}");
    // Refused before loading: the plan is there, nothing of a run.
    assert!(peak(&refused) > two);
    assert!(!refused.join("config.toml").exists());
    assert!(!refused.join("metrics.jsonl").exists());

    // Under `memory_check = "warn"` the same run trains.
    let warned = dir.join("warned");
    let output = train(
        &warned,
        8,
        &["--memory-limit", &limit, "--memory-check", "warn"],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning: memory plan: `--per-device-train-batch-size 2` fits"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unknown_memory_check_is_refused_with_the_values() {
    let dir = scratch("values");
    let output = train(&dir.join("run"), 2, &["--memory-check", "maybe"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("memory_check"), "{stderr}");
    assert!(stderr.contains("refuse, warn, off"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GGUF file (llama.cpp's converter's, of the tiny Qwen2 folder) is planned from its header as its
/// folder is from `config.json` and the safetensors headers: the same inputs and every term the same
/// but the tokenizer's, which is estimated from the file's vocabulary (within a third of the folder's
/// `tokenizer.json`).
#[test]
fn a_gguf_file_is_planned_as_its_folder() {
    let dir = scratch("gguf");
    let plans: Vec<serde_json::Value> = ["models/qwen2", "models/gguf/converted/qwen2.gguf"]
        .into_iter()
        .enumerate()
        .map(|(index, model)| {
            let out = dir.join(format!("run-{index}"));
            let output = train_model(model, &out, 2, &["--memory-limit", "100"]);
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(output.status.success(), "{stderr}");
            assert!(!stderr.contains("no memory plan"), "{stderr}");
            let text = std::fs::read_to_string(out.join("memory_plan.json")).unwrap();
            serde_json::from_str(&text).unwrap()
        })
        .collect();
    let (folder, gguf) = (&plans[0], &plans[1]);
    assert_eq!(folder["inputs"], gguf["inputs"]);
    let terms = |plan: &serde_json::Value| -> Vec<(String, u64)> {
        plan["terms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|term| {
                let name = term["name"].as_str().unwrap().to_string();
                (name, term["bytes"].as_u64().unwrap())
            })
            .collect()
    };
    let (folder, gguf) = (terms(folder), terms(gguf));
    assert_eq!(folder.len(), gguf.len());
    for ((name, folder), (other, gguf)) in folder.iter().zip(&gguf) {
        assert_eq!(name, other);
        if name == "tokenizer" {
            let ratio = *gguf as f64 / *folder as f64;
            assert!(
                (0.67..1.5).contains(&ratio),
                "tokenizer: {gguf} against {folder}"
            );
        } else {
            assert_eq!(folder, gguf, "{name}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `holo train --quantized --use-peft` is planned at its blocks' bytes: over llama.cpp's converter's Q8_0
/// file of the tiny Llama, its weights are the same file's dequantized plan less the projections' f32
/// (every `blk.N` matrix the loader keeps) plus their blocks' bytes and the untied head's blocks beside
/// its dense tensor, read off the file's header here with candle's reader; one projection's expansion
/// (the MLP's 128 × 64, in f32) joins the passes; every other term is the dequantized run's. Between the
/// two peaks, the run in blocks fits and trains and the dequantized one is refused before loading.
#[test]
fn a_quantized_run_is_planned_at_its_blocks_bytes() {
    use candle_core::quantized::gguf_file;
    let model = "models/gguf/converted/llama-q8_0.gguf";
    let dir = scratch("quantized");
    let plan = |out: &Path, extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["--use-peft"];
        args.extend_from_slice(extra);
        let output = train_model(model, out, 2, &args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("memory plan (peak resident memory, by term):"),
            "{stderr}"
        );
        serde_json::from_str(&std::fs::read_to_string(out.join("memory_plan.json")).unwrap())
            .unwrap()
    };
    let term = |plan: &serde_json::Value, name: &str| -> u64 {
        plan["terms"]
            .as_array()
            .unwrap()
            .iter()
            .find(|term| term["name"] == name)
            .map(|term| term["bytes"].as_u64().unwrap())
            .unwrap()
    };
    let dense = plan(&dir.join("dense"), &["--memory-limit", "100"]);
    let blocks = plan(
        &dir.join("blocks"),
        &["--memory-limit", "100", "--quantized"],
    );
    assert_eq!(blocks["inputs"]["quantized"], true);
    assert_eq!(dense["inputs"]["quantized"], false);

    let mut file = std::fs::File::open(fixture(model)).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let (mut elements, mut bytes, mut head, mut largest) = (0u64, 0u64, 0u64, 0u64);
    for (name, info) in &content.tensor_infos {
        let count = info.shape.elem_count() as u64;
        let stored =
            count / info.ggml_dtype.block_size() as u64 * info.ggml_dtype.type_size() as u64;
        if name.starts_with("blk.") && info.shape.rank() == 2 {
            (elements, bytes, largest) = (elements + count, bytes + stored, largest.max(count));
        } else if name == "output.weight" {
            head = stored;
        }
    }
    assert_eq!((largest, head), (128 * 64, 512 * 64 / 32 * 34));
    assert_eq!(
        term(&blocks, "weights"),
        term(&dense, "weights") - 4 * elements + bytes + head
    );
    assert_eq!(term(&blocks, "expansion"), 4 * largest);
    assert_eq!(term(&dense, "expansion"), 0);
    for name in dense["terms"].as_array().unwrap().iter() {
        let name = name["name"].as_str().unwrap();
        if !["weights", "expansion"].contains(&name) {
            assert_eq!(term(&blocks, name), term(&dense, name), "{name}");
        }
    }

    let (low, high) = (
        blocks["peak"]["bytes"].as_u64().unwrap(),
        dense["peak"]["bytes"].as_u64().unwrap(),
    );
    assert!(low < high, "{low} against {high}");
    let limit = format!("{}", (low + high) as f64 / 2.0 / (1u64 << 30) as f64);
    let fits = dir.join("fits");
    let output = train_model(
        model,
        &fits,
        2,
        &["--use-peft", "--quantized", "--memory-limit", &limit],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(fits.join("metrics.jsonl").exists());
    let output = train_model(
        model,
        &dir.join("refused"),
        2,
        &["--use-peft", "--memory-limit", &limit],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("error: memory plan:"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
