//! tinker-cookbook 0.5.8 (from PyPI, in the venv `scripts/prepare.sh tinker` makes) against `holo
//! tinker-serve` on the tiny Qwen2 fixture, its code unchanged: only its configuration, and data written
//! here, offline. Its minimal loops (`recipes/sl_loop.py`, `recipes/rl_loop.py`) and its full recipes
//! (`recipes.chat_sl.train`, `recipes.math_rl.train`).
#![cfg(feature = "cli")]

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use super::tinker_serve::{model_dir, serve_as};
use crate::common::process::Process;
use crate::common::tempdir::Dir;

/// One of tinker-cookbook's recipes (`python -m MODULE ARGS…`) against `base`, at most five minutes,
/// offline, in the folder `dir` (where the minimal loops find the models and data sets they name) with
/// its Hugging Face cache there too.
fn cookbook(python: &Path, module: &str, base: &str, dir: &Path, args: &[String], log: &str) {
    let mut command = std::process::Command::new(python);
    command
        .args(["-m", module])
        .arg(format!("base_url={base}"))
        .args(args)
        .current_dir(dir)
        .env("TINKER_API_KEY", "tml-holo-test")
        .env("HF_HOME", dir.join("hf"))
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .env_remove("TINKER_BASE_URL")
        .env_remove("WANDB_API_KEY");
    let mut process = Process::spawn(&mut command, dir.join(log));
    let (status, output) = process.finish(Duration::from_secs(300));
    assert!(status.success(), "{module} failed:\n{output}");
}

fn arg(key: &str, value: impl std::fmt::Display) -> String {
    format!("{key}={value}")
}

fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()))
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

fn write_jsonl(path: &Path, rows: impl Iterator<Item = Value>) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let text: String = rows.map(|row| row.to_string() + "\n").collect();
    std::fs::write(path, text).unwrap();
}

/// The model the minimal loops train: they take the renderer from tinker-cookbook's table of models, so
/// the fixture is served under a name there (Qwen3's chat format, which its tokenizer has), and the
/// tokenizer is loaded from the folder of that name under the loops' working directory.
const LOOP_MODEL: &str = "Qwen/Qwen3-8B";

/// `rl_loop.py`'s few-shot turn before each question, and its instruction after it.
const SUFFIX: &str = " Provide a numerical answer without units, written inside \\boxed{}.";
const SHOT: &str =
    "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e \
                    8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}";

/// The questions of both loops' data: each one's answer is 1.
fn question(k: usize) -> String {
    format!("What is {} minus {k}?", k + 1)
}

/// The supervised loop's rows and batch, and the RL loop's batch, groups and steps.
const SL_ROWS: usize = 256;
const SL_BATCH: usize = 4;
const RL_BATCH: usize = 4;
const RL_GROUP: usize = 8;
const RL_STEPS: usize = 2;

/// tinker-cookbook's minimal loops, unchanged, one after the other on one log folder, as a supervised
/// warm start then RL: `sl_loop` (cross-entropy, its linear learning-rate decay) and `rl_loop`
/// (sampling, GSM8K's `\boxed{}` reward, group-centred advantages, `importance_sampling`), which
/// resumes from the supervised loop's final state through the cookbook's own `checkpoints.jsonl`.
///
/// The loops load `HuggingFaceH4/no_robots` and `openai/gsm8k` with `datasets.load_dataset` and have no
/// option for another data set; `datasets` reads a folder of that relative path as a local data set
/// before it asks the Hub, so the loops run in a folder holding tiny ones written here. A random model
/// never writes `\boxed{…}`, so every RL group's rewards would be equal (0) and the loop would skip
/// every step: the supervised rows teach the answer's form, with the right answer (1) in half of them
/// and a wrong one (2) in the other half, so that each RL group's rewards differ.
#[test]
fn tinker_cookbook_minimal_loops_run_against_holo_tinker_serve() {
    let Some(venv) = crate::common::components::tinker() else {
        return;
    };
    let python = venv.join("bin/python");
    let dir = Dir::new("tinker-cookbook-loops");
    let root = dir.path();
    let store = root.join("store");
    let server = serve_as(&store, LOOP_MODEL);

    let tokenizer = root.join(LOOP_MODEL);
    std::fs::create_dir_all(&tokenizer).unwrap();
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(model_dir().join(file), tokenizer.join(file)).unwrap();
    }
    let conversation = |question: &str, answer: &str| {
        json!([
            {"role": "user", "content": format!("How many r's are in strawberry?{SUFFIX}")},
            {"role": "assistant", "content": SHOT},
            {"role": "user", "content": format!("{question}{SUFFIX}")},
            {"role": "assistant", "content": answer},
        ])
    };
    write_jsonl(
        &root.join("HuggingFaceH4/no_robots/train.jsonl"),
        (0..SL_ROWS).map(|i| {
            let answer = format!("\\boxed{{{}}}", 1 + i % 2);
            json!({"messages": conversation(&question(i / 2 % 8), &answer)})
        }),
    );
    // The RL loop resumes at the supervised loop's last batch number and runs to `max_steps`.
    let sl_batches = SL_ROWS / SL_BATCH;
    let rl_rows = RL_BATCH * (sl_batches + RL_STEPS);
    write_jsonl(
        &root.join("openai/gsm8k/main/train.jsonl"),
        (0..rl_rows).map(|j| {
            json!({"question": question(j % 8), "answer": format!("{}\n#### 1", question(j % 8))})
        }),
    );
    // GSM8K's configuration is named `main`, as on the Hub.
    std::fs::write(
        root.join("openai/gsm8k/README.md"),
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n",
    )
    .unwrap();

    let log = root.join("log");
    let common = [
        arg("model_name", LOOP_MODEL),
        arg("log_path", log.display()),
    ];
    let sl = [
        arg("batch_size", SL_BATCH),
        arg("learning_rate", 1e-2),
        arg("lora_rank", 8),
        arg("save_every", 0),
        // The conversations' first answer is the RL loop's few-shot turn, a prompt there.
        arg("train_on_what", "last_assistant_message"),
    ];
    let module = "tinker_cookbook.recipes.sl_loop";
    cookbook(
        &python,
        module,
        &server.base,
        root,
        &[&common[..], &sl].concat(),
        "sl.log",
    );
    let nll: Vec<f64> = jsonl(&log.join("metrics.jsonl"))
        .iter()
        .map(|step| step["train_mean_nll"].as_f64().unwrap())
        .collect();
    assert_eq!(nll.len(), sl_batches, "{nll:?}");
    assert!(nll.iter().all(|v| v.is_finite()), "{nll:?}");
    // From ln(512) ≈ 6.2 a token towards the coin toss of the digit (ln 2 over the answer's 22 tokens).
    let last: f64 = nll[sl_batches - 4..].iter().sum::<f64>() / 4.0;
    assert!(last < 0.1 * nll[0], "train_mean_nll {nll:?}");

    let rl = [
        arg("batch_size", RL_BATCH),
        arg("group_size", RL_GROUP),
        arg("max_tokens", 32),
        arg("save_every", 1),
        arg("max_steps", sl_batches + RL_STEPS),
    ];
    let module = "tinker_cookbook.recipes.rl_loop";
    cookbook(
        &python,
        module,
        &server.base,
        root,
        &[&common[..], &rl].concat(),
        "rl.log",
    );
    let steps: Vec<Value> = jsonl(&log.join("metrics.jsonl"))
        .into_iter()
        .filter(|step| step.get("reward/total").is_some())
        .collect();
    assert_eq!(steps.len(), RL_STEPS, "{steps:?}");
    for step in &steps {
        let reward = step["reward/total"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&reward), "{step}");
    }
    // The loop logs optim_step's metrics only from a step it trained (a batch whose groups all had
    // equal rewards is skipped): the first RL step trained.
    let grad_norm = steps[0]["grad_norm"].as_f64().unwrap_or(f64::NAN);
    assert!(grad_norm.is_finite() && grad_norm > 0.0, "{}", steps[0]);

    // The RL loop's first checkpoint is the resumed state before any step; its last, after them.
    let saved = jsonl(&log.join("checkpoints.jsonl"));
    let adapter = |name: &str| -> Vec<u8> {
        let record = saved
            .iter()
            .rev()
            .find(|record| record["name"] == name)
            .unwrap_or_else(|| panic!("no checkpoint `{name}` in {saved:?}"));
        let path = record["state_path"].as_str().unwrap();
        let folder = store.join(path.strip_prefix("tinker://").unwrap());
        std::fs::read(folder.join("adapter.safetensors")).unwrap()
    };
    let first = format!("{sl_batches:06}");
    assert_ne!(
        adapter(&first),
        adapter("final"),
        "the RL loop's steps left the adapter as it was"
    );
}

/// tinker-cookbook 0.5.8's full recipes, unchanged: `recipes.math_rl.train` (its RL loop, on its
/// synthetic arithmetic environment: sampling, rewards, `importance_sampling`, checkpoints) for two
/// steps, and `recipes.chat_sl.train` (its supervised loop) on eight conversations from a JSONL file for
/// six steps, whose training loss falls. They take a renderer by name, so the model is served under its
/// folder's path, from which the cookbook loads the tokenizer.
#[test]
fn tinker_cookbook_recipes_run_against_holo_tinker_serve() {
    let Some(venv) = crate::common::components::tinker() else {
        return;
    };
    let python = venv.join("bin/python");
    let dir = Dir::new("tinker-cookbook");
    let root = dir.path();
    let model = model_dir().display().to_string();
    let server = serve_as(&root.join("store"), &model);

    let rl = root.join("rl");
    cookbook(
        &python,
        "tinker_cookbook.recipes.math_rl.train",
        &server.base,
        root,
        &[
            arg("model_name", &model),
            arg("env", "arithmetic"),
            arg("renderer_name", "qwen3"),
            arg("lora_rank", "8"),
            arg("group_size", "2"),
            arg("groups_per_batch", "2"),
            arg("max_tokens", "8"),
            arg("max_steps", "2"),
            arg("eval_every", "0"),
            arg("save_every", "1"),
            arg("log_path", rl.display()),
            arg("behavior_if_log_dir_exists", "delete"),
        ],
        "rl.log",
    );
    let steps = jsonl(&rl.join("metrics.jsonl"));
    assert_eq!(steps.len(), 2, "{steps:?}");
    for step in &steps {
        let reward = step["env/all/reward/total"].as_f64().unwrap();
        assert!(reward.is_finite(), "{step}");
    }
    let saved = jsonl(&rl.join("checkpoints.jsonl"));
    let state = saved.last().unwrap()["state_path"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        state.starts_with("tinker://") && state.contains("/weights/"),
        "{state}"
    );

    let data = root.join("chat.jsonl");
    write_jsonl(
        &data,
        (0..8).map(|i| {
            json!({"messages": [
                {"role": "user", "content": format!("What is {i} plus {i}?")},
                {"role": "assistant", "content": format!("{i} plus {i} is {}.", 2 * i)},
            ]})
        }),
    );
    let sl = root.join("sl");
    cookbook(
        &python,
        "tinker_cookbook.recipes.chat_sl.train",
        &server.base,
        root,
        &[
            arg("model_name", &model),
            arg("dataset", data.display()),
            arg("renderer_name", "qwen3"),
            arg("lora_rank", "8"),
            arg("batch_size", "4"),
            arg("num_epochs", "3"),
            arg("learning_rate", "1e-2"),
            arg("max_length", "256"),
            arg("eval_every", "0"),
            arg("infrequent_eval_every", "0"),
            arg("save_every", "0"),
            arg("log_path", sl.display()),
            arg("behavior_if_log_dir_exists", "delete"),
        ],
        "sl.log",
    );
    let nll: Vec<f64> = jsonl(&sl.join("metrics.jsonl"))
        .iter()
        .filter_map(|step| step["train_mean_nll"].as_f64())
        .collect();
    assert_eq!(nll.len(), 6, "{nll:?}");
    assert!(nll[5] < 0.5 * nll[0], "train_mean_nll {nll:?}");
}
