//! `holo train` end to end on the committed tiny Qwen2: a run killed with SIGKILL and resumed writes the
//! same metrics and rollouts as an uninterrupted one; bad options fail before any work, naming the key.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};

use crate::common::{holo_command, repo, run_metrics as metrics, tiny_grpo};

/// A fresh folder for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("holo-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `holo train` on the test environment with the options every test here shares.
fn train_args(out: &Path, steps: u32) -> Vec<String> {
    tiny_grpo(
        "short.hol",
        out,
        steps,
        &["--num-iterations", "2", "--save-steps", "1"],
    )
}

fn run(args: &[String]) -> Output {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    holo_command(&args).output().unwrap()
}

/// Trains `steps` steps on `data` uninterrupted, then again killed with SIGKILL right after its second
/// checkpoint and resumed: the two runs must write the same metrics and rollouts. Returns the metrics.
fn killed_and_resumed(
    name: &str,
    holoware: &str,
    data: &str,
    steps: u32,
    extra: &[&str],
) -> Vec<serde_json::Value> {
    let dir = scratch(name);
    let fixtures = repo().join("holo-runtime/tests/fixtures/train");
    let args_for = |out: &Path| {
        let mut args = train_args(out, steps);
        args[1] = fixtures.join(holoware).to_str().unwrap().into();
        let data_at = args.iter().position(|arg| arg == "--data").unwrap() + 1;
        args[data_at] = fixtures.join(data).to_str().unwrap().into();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let whole = dir.join("whole");
    let output = run(&args_for(&whole));
    assert!(output.status.success(), "{output:?}");

    let killed = dir.join("killed");
    let args = args_for(&killed);
    let args_ref: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut child = holo_command(&args_ref)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Kill it as soon as it reports its second checkpoint: mid-step, maybe mid-save.
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let mut saves = 0;
    for line in stderr.lines() {
        let line = line.unwrap();
        if line.starts_with("saved ") {
            saves += 1;
            if saves == 2 {
                child.kill().unwrap();
                break;
            }
        }
    }
    child.wait().unwrap();
    assert_eq!(saves, 2, "the run ended before its second checkpoint");
    let done = metrics(&killed).len();
    assert!(
        done < steps as usize,
        "the run finished ({done} steps) before it was killed"
    );

    let mut resumed = args_for(&killed);
    resumed.push("--resume".into());
    let output = run(&resumed);
    assert!(output.status.success(), "{output:?}");
    assert_eq!(metrics(&killed), metrics(&whole));
    for file in ["rollouts.jsonl", "eval_rollouts.jsonl"] {
        // Records are written as rollouts finish, in an order the scheduler's timing decides, and the
        // sampling log-probabilities depend on which sequences shared a batch by float rounding only.
        let records = |dir: &Path| {
            let text = std::fs::read_to_string(dir.join(file)).unwrap();
            let mut records: Vec<serde_json::Value> = text
                .lines()
                .map(|line| serde_json::from_str(line).unwrap())
                .collect();
            records.sort_by_key(|r| {
                (
                    r["step"].as_u64(),
                    r["row_index"].as_u64(),
                    r["rollout_index"].as_u64(),
                )
            });
            records
        };
        let (resumed, uninterrupted) = (records(&killed), records(&whole));
        assert_eq!(resumed.len(), uninterrupted.len(), "{file}");
        for (a, b) in resumed.iter().zip(&uninterrupted) {
            crate::common::json::assert_close(
                a,
                b,
                &format!(
                    "{file}: row {} rollout {}",
                    a["row_index"], a["rollout_index"]
                ),
            );
        }
    }
    // save_total_limit: the two newest checkpoints only.
    let mut checkpoints: Vec<String> = std::fs::read_dir(&killed)
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| name.contains("checkpoint"))
        .collect();
    checkpoints.sort();
    assert_eq!(
        checkpoints,
        [
            format!("checkpoint-{}", steps - 1),
            format!("checkpoint-{steps}")
        ]
    );
    let metrics = metrics(&whole);
    std::fs::remove_dir_all(dir).unwrap();
    metrics
}

#[test]
fn a_run_killed_at_any_moment_resumes_to_the_same_metrics() {
    killed_and_resumed("kill", "short.hol", "rows.jsonl", 24, &[]);
}

/// ERL's memory (reflections whose retry came within the length limit) is in the checkpoints: the
/// resumed run's reflections read the same memory as the uninterrupted run's.
#[test]
fn an_erl_run_resumes_to_the_same_metrics_and_memory() {
    killed_and_resumed(
        "kill-erl",
        "erl.hol",
        "rows.jsonl",
        12,
        &["--erl", "true", "--erl-algorithm", "2"],
    );
}

#[test]
fn a_lora_run_with_dropout_resumes_to_the_same_metrics() {
    killed_and_resumed(
        "kill-lora",
        "short.hol",
        "rows.jsonl",
        16,
        &[
            "--use-peft",
            "--lora-r",
            "4",
            "--lora-dropout",
            "0.1",
            "--lora-target-modules",
            r#"["q_proj", "v_proj", "down_proj"]"#,
            "--learning-rate",
            "0.03",
        ],
    );
}

/// A curriculum over `levels.jsonl` (difficulties 1, 2, 3, four rows each) with dynamic sampling: the
/// level, its window and the data position are in the checkpoints, so the resumed run draws what the
/// uninterrupted one drew. The threshold is the lowest reward there is, so each level lasts until its
/// window of three groups is full, whatever the random model writes.
#[test]
fn a_curriculum_run_advances_levels_and_resumes_to_the_same_metrics() {
    let metrics = killed_and_resumed(
        "kill-curriculum",
        "short.hol",
        "levels.jsonl",
        12,
        &[
            "--difficulty-column",
            "difficulty",
            "--curriculum-window",
            "3",
            "--curriculum-threshold",
            "-1",
            "--dynamic-sampling",
            "--max-num-gen-batches",
            "3",
        ],
    );
    let levels: Vec<f64> = metrics
        .iter()
        .filter_map(|m| m.get("curriculum/level")?.as_f64())
        .collect();
    assert!(levels.windows(2).all(|w| w[0] <= w[1]), "{levels:?}");
    assert_eq!(
        (levels[0], levels[levels.len() - 1]),
        (0.0, 2.0),
        "{levels:?}"
    );
    assert!(levels.contains(&1.0), "{levels:?}");
    let difficulties: Vec<f64> = metrics
        .iter()
        .filter_map(|m| m.get("curriculum/difficulty")?.as_f64())
        .collect();
    assert_eq!(difficulties.last(), Some(&3.0));
    assert!(metrics
        .iter()
        .any(|m| m.get("dynamic_sampling/refills").is_some()));
}

#[test]
fn the_run_learns_what_its_reward_asks() {
    // The reward prefers replies of at most 24 characters; the tiny random model's replies are mostly
    // longer, and GRPO brings the mean reward up to the maximum, 0.
    let dir = scratch("learn");
    let out = dir.join("run");
    let mut args = train_args(&out, 30);
    args.extend(
        [
            "--num-generations",
            "8",
            "--per-device-train-batch-size",
            "16",
            "--gradient-accumulation-steps",
            "1",
            "--num-iterations",
            "1",
            "--learning-rate",
            "0.01",
            "--seed",
            "3",
        ]
        .map(String::from),
    );
    let output = run(&args);
    assert!(output.status.success(), "{output:?}");
    let metrics = metrics(&out);
    let rewards: Vec<f64> = metrics
        .iter()
        .filter_map(|m| m.get("reward").and_then(serde_json::Value::as_f64))
        .collect();
    let mean = |values: &[f64]| values.iter().sum::<f64>() / values.len() as f64;
    let (first, last) = (mean(&rewards[..5]), mean(&rewards[rewards.len() - 5..]));
    assert!(
        last > first + 0.03,
        "mean reward of the first 5 steps {first}, of the last 5 {last}: {rewards:?}"
    );
    for key in [
        "loss",
        "grad_norm",
        "learning_rate",
        "kl",
        "entropy",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "num_tokens",
        "eval/reward",
    ] {
        assert!(
            metrics.iter().any(|m| m.get(key).is_some()),
            "no {key} in metrics.jsonl"
        );
    }
    assert!(out.join("plots/overview.png").is_file());
    std::fs::remove_dir_all(dir).unwrap();
}

/// PPO's value model is in the checkpoints with its optimizer moments: the resumed run repeats the
/// uninterrupted one.
#[test]
fn a_ppo_run_killed_at_any_moment_resumes_to_the_same_metrics() {
    let metrics = killed_and_resumed(
        "kill-ppo",
        "short.hol",
        "rows.jsonl",
        12,
        &[
            "--algorithm",
            "ppo",
            "--num-iterations",
            "1",
            "--num-mini-batches",
            "2",
            "--num-ppo-epochs",
            "2",
            "--kl-coef",
            "0.05",
        ],
    );
    for key in [
        "loss/value_avg",
        "val/clipfrac_avg",
        "objective/kl",
        "policy/approxkl_avg",
    ] {
        assert!(metrics.iter().all(|m| m.get(key).is_some()), "no {key}");
    }
}

#[test]
fn a_ppo_run_learns_what_its_reward_asks() {
    // As GRPO's test above: the value model's baseline is what PPO learns against.
    let dir = scratch("learn-ppo");
    let out = dir.join("run");
    let mut args = train_args(&out, 30);
    args.extend(
        [
            "--algorithm",
            "ppo",
            "--num-generations",
            "4",
            "--per-device-train-batch-size",
            "8",
            "--gradient-accumulation-steps",
            "1",
            "--num-mini-batches",
            "2",
            "--num-iterations",
            "1",
            "--learning-rate",
            "0.003",
            "--save-steps",
            "100",
            "--seed",
            "3",
        ]
        .map(String::from),
    );
    let output = run(&args);
    assert!(output.status.success(), "{output:?}");
    let metrics = metrics(&out);
    let series = |key: &str| -> Vec<f64> {
        metrics
            .iter()
            .filter_map(|m| m.get(key).and_then(serde_json::Value::as_f64))
            .collect()
    };
    let mean = |values: &[f64]| values.iter().sum::<f64>() / values.len() as f64;
    let rewards = series("reward");
    let (first, last) = (mean(&rewards[..5]), mean(&rewards[rewards.len() - 5..]));
    assert!(
        last > first + 0.03,
        "mean reward of the first 5 steps {first}, of the last 5 {last}: {rewards:?}"
    );
    let value_loss = series("loss/value_avg");
    assert!(
        mean(&value_loss[value_loss.len() - 5..]) < mean(&value_loss[..5]),
        "the value model did not learn: {value_loss:?}"
    );
    assert!(out.join("checkpoint-30/value_model.safetensors").is_file());
    std::fs::remove_dir_all(dir).unwrap();
}

/// A run killed right after a rollback (the event written, the later checkpoints and records cut back)
/// resumes to the same end: it repeats the steps from the restored checkpoint, trips again where the
/// uninterrupted run did, and writes the same rollback events (their abandoned steps' timings aside).
#[test]
fn a_run_killed_right_after_a_rollback_resumes_to_the_same_rollbacks() {
    let dir = scratch("kill-rollback");
    let args_for = |out: &Path| {
        let mut args = train_args(out, 8);
        args.extend(["--rollback-kl", "0.02", "--max-rollbacks", "2"].map(String::from));
        args
    };
    let events = |out: &Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(out.join("rollbacks.jsonl"))
            .unwrap()
            .lines()
            .map(|line| {
                let mut event: serde_json::Value = serde_json::from_str(line).unwrap();
                for step in event["abandoned"].as_array_mut().unwrap() {
                    step.as_object_mut()
                        .unwrap()
                        .retain(|name, _| !holo_runtime::train::run::is_wall_clock(name));
                }
                event
            })
            .collect()
    };
    let whole = dir.join("whole");
    let (code, stderr) = stderr_of(&args_for(&whole));
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("after 2 rollbacks (max_rollbacks)"),
        "{stderr}"
    );
    assert_eq!(events(&whole).len(), 3);

    let killed = dir.join("killed");
    let args = args_for(&killed);
    let args_ref: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut child = holo_command(&args_ref)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let mut rolled_back = false;
    for line in stderr.lines() {
        if line.unwrap().starts_with("rollback 1 of 2") {
            child.kill().unwrap();
            rolled_back = true;
            break;
        }
    }
    child.wait().unwrap();
    assert!(rolled_back, "the run ended before its first rollback");
    // Killed somewhere after it: before its next step, or in it (its next trip is two steps away).
    assert!(!events(&killed).is_empty());

    let mut resumed = args_for(&killed);
    resumed.push("--resume".into());
    let (code, stderr) = stderr_of(&resumed);
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(events(&killed), events(&whole));
    assert_eq!(metrics(&killed), metrics(&whole));
    std::fs::remove_dir_all(dir).unwrap();
}

fn stderr_of(args: &[String]) -> (i32, String) {
    let output = run(args);
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn bad_options_fail_before_any_work_naming_the_key() {
    let dir = scratch("bad");
    let out = dir.join("run");
    let mut args = train_args(&out, 2);
    args.extend(["--num-generation".into(), "4".into()]);
    let (code, stderr) = stderr_of(&args);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("--num-generation") && stderr.contains("did you mean --num-generations"),
        "{stderr}"
    );

    let mut args = train_args(&out, 2);
    args.extend(["--loss-type".into(), "ppo".into()]);
    let (code, stderr) = stderr_of(&args);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("--loss-type")
            && stderr.contains("loss_type")
            && stderr.contains("grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo"),
        "{stderr}"
    );

    let mut args = train_args(&out, 2);
    args.extend(["--num-generations".into(), "3".into()]);
    let (code, stderr) = stderr_of(&args);
    assert_eq!(code, 2);
    assert!(stderr.contains("num_generations"), "{stderr}");

    let toml = dir.join("train.toml");
    std::fs::write(&toml, "beta = 0.1\nweight_decay = \"fast\"\n").unwrap();
    let mut args = train_args(&out, 2);
    args.extend(["--config".into(), toml.to_str().unwrap().into()]);
    let (code, stderr) = stderr_of(&args);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("train.toml:2") && stderr.contains("weight_decay"),
        "{stderr}"
    );
    // An option that would change nothing: tried as a new user would, `--lora-r 8` without
    // `--use-peft true` trained every weight without a word.
    let mut args = train_args(&out, 2);
    args.extend(["--lora-r".into(), "8".into()]);
    let (code, stderr) = stderr_of(&args);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("--lora-r")
            && stderr.contains("has no effect here")
            && stderr.contains("use_peft"),
        "{stderr}"
    );
    assert!(!out.exists(), "a refused run leaves no run folder");
    let mut args = train_args(&out, 2);
    args.extend(["--rollback-lr-factor".into(), "2".into()]);
    let (code, stderr) = stderr_of(&args);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("--rollback-lr-factor") && stderr.contains("rollback_lr_factor"),
        "{stderr}"
    );

    // Training precisions: bf16 is CUDA's, f16 is not one.
    for (extra, said) in [
        (["--dtype", "bf16"], "--dtype bf16: the CPU trains in f32"),
        (
            ["--dtype", "f16"],
            "--dtype f16: training in f16 needs loss scaling",
        ),
        (["--dtype", "f8"], "unknown --dtype \"f8\": f32 or bf16"),
    ] {
        let mut args = train_args(&out, 2);
        args.extend(extra.iter().map(|s| s.to_string()));
        let (code, stderr) = stderr_of(&args);
        assert_eq!(code, 2, "{extra:?}: {stderr}");
        assert!(stderr.contains(said), "{extra:?}: {stderr}");
    }

    // PPO's options: its own, and GRPO's that it replaces.
    for (extra, key) in [
        (vec!["--algorithm", "ppx"], "grpo, ppo"),
        (vec!["--algorithm", "ppo"], "num_iterations"),
        (
            vec![
                "--algorithm",
                "ppo",
                "--num-iterations",
                "1",
                "--lam",
                "1.5",
            ],
            "lam",
        ),
        (
            vec![
                "--algorithm",
                "ppo",
                "--num-iterations",
                "1",
                "--steps-per-generation",
                "3",
            ],
            "steps_per_generation",
        ),
    ] {
        let mut args = train_args(&out, 2);
        args.extend(extra.iter().map(|s| s.to_string()));
        let (code, stderr) = stderr_of(&args);
        assert_eq!(code, 2, "{extra:?}: {stderr}");
        assert!(stderr.contains(key), "{extra:?}: {stderr}");
    }

    // The rows have no `level`: refused naming the row and the column.
    let mut args = train_args(&out, 2);
    args.extend(["--difficulty-column".into(), "level".into()]);
    let (code, stderr) = stderr_of(&args);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("training row 1") && stderr.contains("`level`"),
        "{stderr}"
    );
    assert!(!out.exists(), "a refused run wrote {}", out.display());

    // A finished run is refused as a new run, and resumed only with its own options.
    assert!(run(&train_args(&out, 2)).status.success());
    let (code, stderr) = stderr_of(&train_args(&out, 2));
    assert_eq!(code, 2);
    assert!(stderr.contains("--resume"), "{stderr}");
    let mut args = train_args(&out, 2);
    args.extend(["--beta".into(), "0.5".into(), "--resume".into()]);
    let (code, stderr) = stderr_of(&args);
    assert_eq!(code, 2);
    assert!(stderr.contains("`beta`"), "{stderr}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_word_problem_example_runs_as_the_readme_gives_it() {
    // The README's SmolLM2 example, with the committed tiny model in place of the GGUF file (which a test
    // cannot download) and a budget of two short steps: the environment, its data and the example's
    // options must stay valid together.
    let dir = scratch("wordproblems");
    let out = dir.join("run");
    let args: Vec<String> = [
        "train",
        "hol/wordproblems.hol",
        "--model",
        "holo-runtime/tests/fixtures/models/qwen2",
        "--data",
        "examples/data/wordproblems/train.jsonl",
        "--eval-data",
        "examples/data/wordproblems/test.jsonl",
        "--config",
        "examples/wordproblems/train.toml",
        "--out",
        out.to_str().unwrap(),
        "--max-steps",
        "2",
        "--per-device-train-batch-size",
        "16",
        "--max-completion-length",
        "8",
        "--eval-on-start",
        "false",
    ]
    .map(String::from)
    .to_vec();
    let output = run(&args);
    assert!(output.status.success(), "{output:?}");
    let metrics = metrics(&out);
    assert_eq!(metrics.len(), 2, "{metrics:?}");
    for key in ["rewards/math_answer/mean", "rewards/format/mean"] {
        assert!(
            metrics.iter().all(|m| m.get(key).is_some()),
            "no {key} in {metrics:?}"
        );
    }
    let config = std::fs::read_to_string(out.join("config.toml")).unwrap();
    for line in ["use_peft = true", "lora_r = 16", "temperature = 0.7"] {
        assert!(config.contains(line), "{line} not in {config}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// A run records what made it; `--resume` on changed data is refused naming the file, and with
/// `--allow-changes` goes on and records the change; `holo runs` lists the run with its inputs.
#[test]
fn a_resume_on_changed_inputs_is_refused_unless_allowed_and_holo_runs_lists_the_run() {
    let dir = scratch("provenance");
    let data = dir.join("rows.jsonl");
    std::fs::copy(
        repo().join("holo-runtime/tests/fixtures/train/rows.jsonl"),
        &data,
    )
    .unwrap();
    let out = dir.join("run");
    let mut args = train_args(&out, 2);
    let at = args.iter().position(|arg| arg == "--data").unwrap();
    args[at + 1] = data.to_str().unwrap().into();
    let output = run(&args);
    assert!(output.status.success(), "{output:?}");
    let recorded: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("provenance.json")).unwrap())
            .unwrap();
    let roles: Vec<&str> = recorded["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|input| input["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["holoware", "data", "eval data", "model"]);
    // The build: this checkout's commit, a dirty flag, the lock file's hash, the holotypes' crate.
    let head = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(repo())
        .output()
        .unwrap();
    let build = &recorded["build"];
    assert_eq!(
        build["commit"].as_str(),
        Some(String::from_utf8_lossy(&head.stdout).trim()),
        "{build}"
    );
    assert!(build["dirty"].is_boolean(), "{build}");
    assert_eq!(build["cargo_lock_sha256"].as_str().map(str::len), Some(64));
    assert!(build["holotypes"]["holo-core"].is_string(), "{build}");

    let mut text = std::fs::read_to_string(&data).unwrap();
    text.push_str("{\"question\": \"What is 1+1?\"}\n");
    std::fs::write(&data, text).unwrap();
    let mut resume = args.clone();
    resume.push("--resume".into());
    let (code, stderr) = stderr_of(&resume);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("the data changed") && stderr.contains("rows.jsonl"),
        "{stderr}"
    );
    assert!(stderr.contains("--allow-changes"), "{stderr}");

    resume.push("--allow-changes".into());
    let output = run(&resume);
    assert!(output.status.success(), "{output:?}");
    let recorded: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("provenance.json")).unwrap())
            .unwrap();
    assert_eq!(recorded["changes"][0]["step"], 2);
    // Recorded, the change no longer counts as one.
    resume.pop();
    assert!(run(&resume).status.success());

    let listed = run(&["runs".into(), dir.to_str().unwrap().into()]);
    assert!(listed.status.success(), "{listed:?}");
    let stdout = String::from_utf8_lossy(&listed.stdout);
    assert!(
        stdout.contains("2 steps") && stdout.contains("best eval/reward"),
        "{stdout}"
    );
    assert!(
        stdout.contains("resumed at step 2 with changes"),
        "{stdout}"
    );
    assert!(stdout.contains("built from commit "), "{stdout}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// `train_args` with another holoware and other rows (training and evaluation) in `dir`.
fn train_args_on(dir: &Path, hol: &str, rows: &str, steps: u32) -> Vec<String> {
    let (hol_path, rows_path) = (dir.join("env.hol"), dir.join("rows.jsonl"));
    std::fs::write(&hol_path, hol).unwrap();
    std::fs::write(&rows_path, rows).unwrap();
    let mut args = train_args(&dir.join("run"), steps);
    args[1] = hol_path.to_str().unwrap().into();
    for flag in ["--data", "--eval-data"] {
        let at = args.iter().position(|arg| arg == flag).unwrap();
        args[at + 1] = rows_path.to_str().unwrap().into();
    }
    args
}

#[test]
fn holotypes_that_fail_stop_the_run_before_any_work_or_at_the_batch_where_all_fail() {
    let rows = "{\"question\": \"What is 4+18?\", \"expected\": \"22\"}\n{\"question\": \"What is 2+8?\"}\n";
    let short =
        |reward: &str| format!("<|+++|>\n<|o_o|>\n<|question|>\n\n<|@_@:reply|>\n{reward}\n");

    // What `holo train` refuses before any work (exit 2, no run folder): its stderr.
    let refused = |name: &str, hol: &str| {
        let dir = scratch(name);
        let (code, stderr) = stderr_of(&train_args_on(&dir, hol, rows, 2));
        assert_eq!(code, 2, "{stderr}");
        assert!(!dir.join("run").exists(), "a refused run wrote its folder");
        std::fs::remove_dir_all(dir).unwrap();
        stderr
    };

    // An argument the holotype refuses: before the model loads, where it is written.
    let stderr = refused(
        "bad-argument",
        &short("<|LengthPenalty var=reply max=short|>"),
    );
    assert!(
        stderr.contains("env.hol:6:1: argument `max` must be an integer, found `short`"),
        "{stderr}"
    );

    // A holotype that fails in every rollout: the run stops at the first batch, saying why.
    let dir = scratch("all-fail");
    let args = train_args_on(&dir, &short("<|Score first|>"), rows, 2);
    let (code, stderr) = stderr_of(&args);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains(
            "step 1: all 8 rollouts failed (rollouts.jsonl holds each error); the first, row "
        ) && stderr.contains("env.hol:6:1: Score: no reward `first` was recorded"),
        "{stderr}"
    );
    let written = std::fs::read_to_string(dir.join("run/rollouts.jsonl")).unwrap();
    assert_eq!(written.lines().count(), 8);
    assert!(written.lines().all(|line| line.contains("\"error\"")));
    std::fs::remove_dir_all(dir).unwrap();

    // A reward whose column a row lacks: refused before any work, naming the row, the column and the
    // tag (`Holotype::needs`); a column of that name that a sampler binds is the sampler's, and needs no
    // data. (What a run does with some failed rollouts: `train::rollouts`' unit test.)
    let stderr = refused("missing-target", &short("<|ExactAnswer var=reply|>"));
    assert!(
        stderr.contains("rows.jsonl:2: missing column `expected` (used at ")
            && stderr.contains("env.hol:6:1)"),
        "{stderr}"
    );
    let dir = scratch("bound-target");
    let hol = "<|+++|>\n<|o_o|>\n<|question|>\n\n<|@_@:reply|>\n<|@_@:expected max_tokens=2|>\n<|ExactAnswer var=reply|>\n";
    let args = train_args_on(&dir, hol, rows, 1);
    let (code, stderr) = stderr_of(&args);
    assert_eq!(code, 0, "{stderr}");
    assert!(!stderr.contains("warning:"), "{stderr}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_run_without_learning_signal_says_so_and_stops_when_asked() {
    // A reward no reply of the tiny random model earns: every group's rewards are identical, so every
    // advantage is 0 (tried as a new user would, a run like this trained 29 steps without a word).
    let rows = "{\"question\": \"What is 4+18?\", \"expected\": \"no reply says this\"}\n{\"question\": \"What is 2+8?\", \"expected\": \"no reply says this\"}\n";
    let hol = "<|+++|>\n<|o_o|>\n<|question|>\n\n<|@_@:reply|>\n<|ExactAnswer var=reply|>\n";
    let dir = scratch("no-signal");
    let mut args = train_args_on(&dir, hol, rows, 6);
    // Every step generates (one pass over each batch), so each step measures the groups anew.
    args.extend(
        [
            "--num-iterations",
            "1",
            "--no-signal-steps",
            "2",
            "--stop-on-no-signal",
        ]
        .map(String::from),
    );
    let output = run(&args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("warning: no learning signal for 2 steps (to step 2)")
            && stderr.contains("frac_reward_zero_std 1, mean reward 0.000")
            && stderr.contains("a rollout's last reply: ")
            && stderr.contains("stopping here (stop_on_no_signal)"),
        "{stderr}"
    );
    assert!(
        stdout.contains("stopped early: every group's rewards were identical"),
        "{stderr}"
    );
    assert_eq!(
        metrics(&dir.join("run"))
            .iter()
            .map(|line| line["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [1, 2],
        "the run ends at the step that completed the streak"
    );
    assert!(
        dir.join("run/checkpoint-2").is_dir(),
        "saved where it stopped"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// `save_strategy = "no"` writes no checkpoint (and refuses the options it makes inert);
/// `save_only_model = true` writes checkpoints without the optimizer's state, which `holo export` reads
/// and `--resume` refuses by name; the guard rails' rollback, which restores a checkpoint, refuses both.
#[test]
fn save_strategy_no_and_save_only_model_write_what_they_say() {
    let dir = scratch("save-options");
    let checkpoints = |out: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(out)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("checkpoint-"))
            .collect();
        names.sort();
        names
    };

    let none = dir.join("none");
    let mut args = tiny_grpo("short.hol", &none, 2, &["--save-strategy", "no"]);
    let (code, stderr) = stderr_of(&args);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("save_total_limit") && stderr.contains("no checkpoint is written"),
        "{stderr}"
    );
    let limit = args
        .iter()
        .position(|arg| arg == "--save-total-limit")
        .unwrap();
    args.drain(limit..limit + 2);
    let output = run(&args);
    assert!(output.status.success(), "{output:?}");
    assert_eq!(metrics(&none).len(), 2);
    assert!(checkpoints(&none).is_empty(), "{:?}", checkpoints(&none));
    args.extend(["--save-steps".into(), "1".into()]);
    let (code, stderr) = stderr_of(&args);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("save_steps") && stderr.contains("no checkpoint is written"),
        "{stderr}"
    );

    let light = dir.join("light");
    let args = train_args(&light, 2)
        .into_iter()
        .chain(["--save-only-model".into(), "true".into()])
        .collect::<Vec<String>>();
    let output = run(&args);
    assert!(output.status.success(), "{output:?}");
    assert_eq!(checkpoints(&light), ["checkpoint-1", "checkpoint-2"]);
    for checkpoint in checkpoints(&light) {
        let folder = light.join(&checkpoint);
        assert!(folder.join("model.safetensors").is_file());
        assert!(
            !folder.join("optimizer.safetensors").exists(),
            "{checkpoint}"
        );
    }
    let exported = dir.join("exported");
    let output = run(&[
        "export".into(),
        light.to_str().unwrap().into(),
        "--out".into(),
        exported.to_str().unwrap().into(),
    ]);
    assert!(output.status.success(), "{output:?}");
    assert!(exported.join("model.safetensors").is_file());
    let mut resumed = args.clone();
    resumed.push("--resume".into());
    let (code, stderr) = stderr_of(&resumed);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("checkpoint-2") && stderr.contains("save_only_model = true"),
        "{stderr}"
    );

    let mut args = train_args(&dir.join("rollback"), 2);
    args.extend(["--save-only-model", "true", "--rollback-kl", "1.0"].map(String::from));
    let (code, stderr) = stderr_of(&args);
    assert_eq!(code, 2);
    assert!(stderr.contains("save_only_model"), "{stderr}");
}
